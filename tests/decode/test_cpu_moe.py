"""The CPU mixture-of-experts step through torch's grouped matmul (`cpu_moe`) against the loop over chosen experts,
and the start-up choice between them (greedy tokens against transformers: test_moe.py)."""

from __future__ import annotations

import pytest
import torch

from pdserve.server.decode import cpu_moe
from pdserve.server.decode.moe import MoeMlp
from pdserve.server.decode.quant import quantize
from pdserve.server.decode.startup import prepare
from pdserve.server.decode.weights import build_model
from pdserve.server.model.config import MoeConfig, load_config
from pdserve.server.model.weights import load_weights


def _mlp(dtype=torch.float32, experts=6, renormalize=False, act="silu") -> MoeMlp:
    torch.manual_seed(0)
    mlp = MoeMlp(MoeConfig(num_experts=experts, top_k=2, intermediate_size=24, renormalize=renormalize), 32, act,
                 dtype, "cpu")
    with torch.no_grad():
        for buffer in mlp.buffers():
            buffer.copy_(torch.randn(buffer.shape) * 0.3)
    return mlp


def test_this_torch_has_a_cpu_grouped_matmul():
    ok, why = cpu_moe.grouped_runs(torch.float32)
    assert ok, why
    assert cpu_moe.grouped_runs(torch.bfloat16)[0]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("tokens", [1, 3, 16])
def test_grouped_step_equals_the_loop_without_calling_each_expert(dtype, tol, act, tokens):
    """The grouped step computes what the loop does (experts unchosen, one row each, many rows each), and runs
    no expert's Linear: the experts' rows go through the two grouped calls."""
    mlp = _mlp(dtype, renormalize=tokens == 3, act=act)
    x = torch.randn(1, tokens, 32, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    with torch.inference_mode():
        want = mlp(x).float()
        calls = []
        for linear in (*mlp.gate_up, *mlp.down):
            linear.register_forward_hook(lambda *_: calls.append(1))
        mlp.group()
        got = mlp(x).float()
        assert not calls
        mlp.grouped = False  # the fallback, forced: the loop again, over the stacked weights' views
        again = mlp(x).float()
    assert calls
    scale = want.abs().max()
    assert ((got - want).abs().max() / scale).item() < tol
    assert ((again - want).abs().max() / scale).item() < tol


def test_choice_keeps_the_loop_for_prepacked_and_quantized_experts():
    packed = _mlp()
    for m in (*packed.gate_up, *packed.down):
        m.prepack(float32=True)
    if packed.gate_up[0].packed:
        assert cpu_moe.choose(packed) == ("loop", cpu_moe.choose(packed)[1])
        assert "prepacked" in cpu_moe.choose(packed)[1]
    int8 = _mlp()
    quantize(int8, "int8")
    path, why = cpu_moe.choose(int8)
    assert path == "loop" and "quantized" in why


def test_choice_on_plain_weights_is_measured_and_the_result_unchanged():
    mlp = _mlp()
    x = torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = mlp(x)
    path, why = cpu_moe.choose(mlp)
    assert path in cpu_moe.PATHS and "grouped" in why and "loop" in why and " us" in why
    assert mlp.grouped is False and mlp.stacked is not None  # measuring leaves the path as it was
    with torch.inference_mode():
        torch.testing.assert_close(mlp(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["plain", "onednn"])
def test_startup_prepare_sets_every_moe_layer_and_says_so(tiny_model, path):
    model_dir = tiny_model("mixtral")
    config = load_config(model_dir)
    model = build_model(config, load_weights(model_dir), dtype=torch.float32)
    said = prepare(model, path)
    assert "mixture of experts on cpu:" in said
    layers = [layer.experts for layer in model.layers if layer.experts is not None]
    chosen = {mlp.grouped for mlp in layers}
    assert len(chosen) == 1  # one path for every layer
    if model.layers[0].experts.gate_up[0].packed:  # oneDNN ran here: the loop keeps the prepacked weights
        assert chosen == {False} and "loop" in said
    assert f"{len(layers)} layers: {'grouped' if chosen == {True} else 'loop'}" in said
