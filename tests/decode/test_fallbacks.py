"""Each quantized-weight path with its kernel and without it (forced off), checked against transformers
run on the same dequantized weights; the CUDA kernels' choice below what they need."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.kvcache.layout import KvLayout
from pdserve.server import hardware
from pdserve.server.decode import cuda_linear
from pdserve.server.decode.kv_cache import PagedKvCache
from pdserve.server.decode.quant import Linear, quantize_weight
from pdserve.server.decode.weights import build_model
from pdserve.server.model.config import load_config
from pdserve.server.model.weights import load_weights

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture
def no_int8_kernel(monkeypatch):
    """torch_probe as on a CPU where torch's weight-only int8 kernel does not run."""
    caps = dataclasses.replace(hardware.torch_probe(), int8_cpu=False)
    monkeypatch.setattr(hardware, "torch_probe", lambda: caps)


def _hf_dequantized_logits(model_dir, fmt: str, ids: list[int]) -> torch.Tensor:
    """transformers in fp32 with every layer projection replaced by its per-row int8/fp8 round trip: the
    math pdserve's dequantizing path computes (fused q|k|v and gate|up rows quantize as the parts do)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in hf.named_modules():
            if name.rsplit(".", 1)[-1] in PROJECTIONS:
                q, scale = quantize_weight(module.weight, fmt)
                module.weight.copy_(q.float() * scale)
        return hf(torch.tensor([ids])).logits[0]  # [S, V]


def _served_logits(model_dir, fmt: str, ids: list[int]):
    config = load_config(model_dir)
    model = build_model(config, load_weights(model_dir), torch.float32, weight_format=fmt)
    cache = PagedKvCache(KvLayout(config.num_layers, config.num_kv_heads, config.head_dim, 4, "float32"), 8)
    with torch.no_grad():
        return model, model.prefill(torch.tensor(ids), [6, 1, 3, 0, 7], cache)  # [S, V]


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_dequantizing_paths_compute_transformers_tokens_on_the_dequantized_weights(tiny_model, fmt, no_int8_kernel):
    model_dir = tiny_model("llama")
    ids = list(range(3, 22))
    model, got = _served_logits(model_dir, fmt, ids)
    assert model.weight_kernel == f"{fmt} weights dequantized per matmul on cpu: the format saves memory only"
    assert not any(m.cpu_int8 for m in model.modules() if isinstance(m, Linear))
    want = _hf_dequantized_logits(model_dir, fmt, ids)
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_the_int8_kernel_where_it_runs_agrees_with_its_fallback(tiny_model):
    if not hardware.torch_probe().int8_cpu:
        pytest.skip(f"torch's weight-only int8 kernel does not run on this CPU ({hardware.cpu().describe()}); "
                    f"the dequantizing fallback is checked above")
    model_dir = tiny_model("llama")
    ids = list(range(3, 22))
    model, got = _served_logits(model_dir, "int8", ids)
    assert model.weight_kernel.startswith("int8 weights through torch's weight-only int8 kernel on cpu")
    want = _hf_dequantized_logits(model_dir, "int8", ids)
    assert (got - want).abs().max().item() <= 1e-3 * want.abs().max().item()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9


def test_fp8_matmuls_need_compute_capability_8_9_and_a_half_dtype(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(cuda_linear, "_runs", lambda *a: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # A100
    assert cuda_linear.pick("fp8", torch.bfloat16, cuda) is None
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # H100 / H200
    assert cuda_linear.pick("fp8", torch.bfloat16, cuda) is cuda_linear.fp8_scaled_mm
    assert cuda_linear.pick("fp8", torch.float32, cuda) is None  # _scaled_mm takes no fp32 activations
    monkeypatch.setattr(cuda_linear, "_runs", lambda *a: False)  # present but failing its check: never used
    assert cuda_linear.pick("fp8", torch.bfloat16, cuda) is None
    assert cuda_linear.pick("int8", torch.bfloat16, torch.device("cpu")) is None


def test_torch_probe_finds_what_this_cpu_runs():
    caps = hardware.torch_probe()
    c = hardware.cpu()
    assert caps.onednn_bf16 in (True, False) and caps.int8_cpu in (True, False)
    if c.cap == "avx2" or (c.arch == "x86_64" and not c.avx512 and not c.has("avx_ne_convert")):
        assert not caps.onednn_bf16
