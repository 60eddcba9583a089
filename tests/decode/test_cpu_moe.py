"""The CPU mixture-of-experts step through the fused C kernel (`cpu_moe_kernel`) and torch's grouped matmul
(`cpu_moe`) against the loop over chosen experts, and the start-up choice between them (greedy tokens against
transformers: test_moe.py)."""

from __future__ import annotations

import pytest
import torch

from pdserve.server import hardware
from pdserve.server.decode import cpu_moe, cpu_moe_kernel
from pdserve.server.decode.moe import MoeMlp
from pdserve.server.decode.quant import buffer_bytes, quantize
from pdserve.server.decode.startup import prepare
from pdserve.server.decode.weights import build_model
from pdserve.server.model.config import MoeConfig, load_config
from pdserve.server.model.weights import load_weights


def _mlp(dtype=torch.float32, experts=6, renormalize=False, act="silu", intermediate=24, top_k=2, hidden=32
         ) -> MoeMlp:
    torch.manual_seed(0)
    mlp = MoeMlp(MoeConfig(num_experts=experts, top_k=top_k, intermediate_size=intermediate, renormalize=renormalize),
                 hidden, act, dtype, "cpu")
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


def _kernel() -> cpu_moe_kernel.Kernel:
    kernel = cpu_moe_kernel.load()
    assert not isinstance(kernel, str), kernel
    return kernel


def test_the_fused_kernel_builds_here():
    """Every development machine has a C compiler: the kernel is built (once, into the cache) and loaded."""
    kernel = _kernel()
    assert hardware.cpu().family in kernel.how and cpu_moe_kernel.build().exists()
    assert kernel.width in (32, 64)  # 4 vectors of 8 (AVX2) or 16 (AVX-512) floats


def test_panels_hold_the_weights_as_the_kernel_reads_them():
    w = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)  # [E, N, K]
    panels = cpu_moe_kernel.pack(w, 2)  # [E, N / 2, K, 2]
    assert panels.shape == (2, 2, 3, 2)
    assert panels[1, 1].tolist() == [[18.0, 21.0], [19.0, 22.0], [20.0, 23.0]]  # expert 1, outputs 2-3, by k


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("tokens,top_k", [(1, 2), (3, 2), (16, 2), (7, 4)])
def test_fused_step_equals_the_loop_without_calling_each_expert(dtype, tol, act, tokens, top_k):
    """The fused kernel computes what the loop does (experts unchosen, one row each, more rows than its block of
    4), in one call: no expert's Linear runs, and they hold no weights any more (the panels replace them)."""
    width = _kernel().width
    mlp = _mlp(dtype, renormalize=tokens == 3, act=act, intermediate=width, hidden=width, top_k=top_k)
    x = torch.randn(1, tokens, width, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    with torch.inference_mode():
        want = mlp(x).float()
        calls = []
        for linear in (*mlp.gate_up, *mlp.down):
            linear.register_forward_hook(lambda *_: calls.append(1))
        bytes_before = buffer_bytes(mlp)
        mlp.fuse_cpu(width)
        got = mlp(x)
    assert not calls and got.dtype == dtype and got.shape == x.shape
    assert mlp.cpu_fused and mlp.stacked is None and {m.weight.numel() for m in (*mlp.gate_up, *mlp.down)} == {0}
    assert buffer_bytes(mlp) == bytes_before  # the panels hold the experts' weights, counted once
    assert ((got.float() - want).abs().max() / want.abs().max()).item() < tol


def test_a_step_past_the_kernels_copies_is_cut_into_calls(monkeypatch):
    """A step of more token copies than one call takes (a long local prefill) runs as several calls, same values."""
    width = _kernel().width
    mlp = _mlp(intermediate=width, hidden=width)
    x = torch.randn(1, 9, width, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        want = mlp(x)
        mlp.fuse_cpu(width)
        monkeypatch.setattr(cpu_moe_kernel, "MAX_COPIES", 4)  # 9 tokens x 2 copies: 5 calls of 2 tokens or fewer
        got = mlp(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_fused_kernel_says_what_it_does_not_take():
    assert cpu_moe_kernel.takes(64, 32, torch.float32, 64) is None
    assert cpu_moe_kernel.takes(4096, 14336, torch.bfloat16, 64) is None  # Mixtral
    assert cpu_moe_kernel.takes(2048, 768, torch.bfloat16, 64) is None  # Qwen3-30B-A3B
    assert "multiples of 64" in cpu_moe_kernel.takes(2048, 1407, torch.float32, 64)
    assert "fp32 or bf16" in cpu_moe_kernel.takes(64, 64, torch.float16, 64)
    mlp = _mlp()  # hidden 32, experts of 24: the kernel is not measured, and the start-up line says why
    path, why = cpu_moe.choose(mlp)
    assert path in ("grouped", "loop") and "no fused kernel: the hidden width (32)" in why


def test_the_kernel_is_built_for_the_capped_instruction_set(monkeypatch, tmp_path):
    """PDSERVE_CPU_ISA caps what the compiler targets; a machine without a compiler is told what to install."""
    info = "model name : Xeon\nflags : avx2 fma avx512f avx512bw avx512vl avx512dq amx_bf16 amx_tile\n"
    assert cpu_moe_kernel.isa_flags(hardware.read_cpu(info, "x86_64", cap="")) == \
        ["-march=x86-64-v4", "-mprefer-vector-width=512"]
    assert cpu_moe_kernel.isa_flags(hardware.read_cpu(info, "x86_64", cap="avx2")) == ["-march=x86-64-v3"]
    assert cpu_moe_kernel.isa_flags(hardware.read_cpu("flags : sse2\n", "x86_64", cap="")) == []
    monkeypatch.setenv("CC", "no-such-cc")
    monkeypatch.setenv(cpu_moe_kernel.CACHE_ENV, str(tmp_path))
    with pytest.raises(RuntimeError, match="install gcc or clang"):
        cpu_moe_kernel.build()


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
    width = _kernel().width
    wide = _mlp(intermediate=width, hidden=width)  # widths the fused kernel takes: it is measured too
    x = torch.randn(1, 5, width, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = wide(x)
    path, why = cpu_moe.choose(wide, prepack=True)
    assert path in cpu_moe.PATHS and "fused " in why and "loop over oneDNN-prepacked experts " in why
    assert not wide.cpu_fused and not wide.gate_up[0].packed  # measuring leaves the path and the weights as they were
    with torch.inference_mode():
        torch.testing.assert_close(wide(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["plain", "onednn"])
def test_startup_prepare_sets_every_moe_layer_and_says_so(tiny_model, path):
    model_dir = tiny_model("mixtral")
    config = load_config(model_dir)
    model = build_model(config, load_weights(model_dir), dtype=torch.float32)
    said = prepare(model, path)
    assert "mixture of experts on cpu:" in said
    layers = [layer.experts for layer in model.layers if layer.experts is not None]
    chosen = {"fused" if mlp.cpu_fused else "grouped" if mlp.grouped else "loop" for mlp in layers}
    assert len(chosen) == 1  # one path for every layer
    (kept,) = chosen
    assert f"{len(layers)} layers: {kept} (" in said
    # the experts are prepacked exactly where the loop was kept on a prepacked matmul path; the rest stays plain
    packed = path == "onednn" and model.layers[0].wqkv.packed
    assert {m.packed for mlp in layers for m in (*mlp.gate_up, *mlp.down)} == {packed and kept == "loop"}
    if kept == "loop":  # the measured layer keeps no stack beside its Linears' weights (prepacked: a copy)
        assert {mlp.stacked for mlp in layers} == {None}


def test_a_kept_loop_over_prepacked_experts_holds_one_copy_of_their_weights(tiny_model, monkeypatch):
    """Measuring stacks the first layer's experts; where the loop is kept and prepacked, that stack is dropped (its
    Linears hold the prepacked weights), so no layer's experts are held twice."""
    model_dir = tiny_model("mixtral")
    model = build_model(load_config(model_dir), load_weights(model_dir), dtype=torch.float32)
    measured = cpu_moe.choose
    monkeypatch.setattr(cpu_moe, "choose", lambda mlp, prepack=False: ("loop", measured(mlp, prepack)[1]))
    said = prepare(model, "onednn")
    layers = [layer.experts for layer in model.layers if layer.experts is not None]
    assert f"{len(layers)} layers: loop (" in said and {mlp.stacked for mlp in layers} == {None}
    if model.layers[0].wqkv.packed:  # oneDNN runs here
        assert {m.packed for mlp in layers for m in (*mlp.gate_up, *mlp.down)} == {True}
