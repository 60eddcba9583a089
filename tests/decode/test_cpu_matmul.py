"""How a bf16 checkpoint computes on a CPU decode worker (server/decode/cpu_matmul.py): oneDNN only where it
runs, every fallback forced and checked here whatever this CPU has."""

from __future__ import annotations

import pytest
import torch

from pdserve.server import hardware
from pdserve.server.decode import cpu_matmul
from pdserve.server.decode.config import DecodeConfig
from pdserve.server.decode.startup import build_native_engine, cpu_path, prepare
from pdserve.server.decode.weights import build_model
from pdserve.server.model.config import load_config
from pdserve.server.model.weights import load_weights

AVX2 = hardware.read_cpu("model name: AMD EPYC\nflags: avx fma avx2\n", "x86_64", cap="")
AMX = hardware.read_cpu("model name: Xeon\nflags: avx2 avx512f avx512bw avx512vl avx512dq avx512_bf16 amx_bf16\n",
                        "x86_64", cap="")


def caps(onednn_bf16: bool) -> hardware.TorchCaps:
    return hardware.TorchCaps(version="x", aten_cpu="AVX2", onednn_bf16=onednn_bf16, onednn_fp16=False)


@pytest.fixture
def capped(monkeypatch):
    """This process as an AVX2-only CPU for pdserve's choices (PDSERVE_CPU_ISA=avx2), probes read afresh."""
    if hardware.cpu().arch != "x86_64":
        pytest.skip(f"PDSERVE_CPU_ISA caps x86_64 CPUs; this one is {hardware.cpu().arch}")
    monkeypatch.setenv("PDSERVE_CPU_ISA", "avx2")
    hardware.cpu.cache_clear()
    hardware.torch_probe.cache_clear()
    yield
    monkeypatch.delenv("PDSERVE_CPU_ISA")
    hardware.cpu.cache_clear()
    hardware.torch_probe.cache_clear()


def test_onednn_only_where_it_runs_and_never_for_quantized_weights():
    assert cpu_matmul.runnable(torch.bfloat16, caps(True), quantized=False) == ["onednn", "plain", "float32"]
    assert cpu_matmul.runnable(torch.bfloat16, caps(False), quantized=False) == ["plain", "float32"]
    assert cpu_matmul.runnable(torch.bfloat16, caps(True), quantized=True) == ["plain", "float32"]
    assert cpu_matmul.choose("auto", torch.bfloat16, AMX, caps(True), 64, 128) == ("onednn", "native bf16 on this CPU")


def test_without_native_bf16_auto_takes_the_faster_measured_path():
    path, why = cpu_matmul.choose("auto", torch.bfloat16, AVX2, caps(False), 64, 128)
    assert path in ("plain", "float32")
    assert why.startswith("no native bf16 on this CPU; fastest measured (plain ") and "float32 " in why
    assert cpu_matmul.describe("float32", torch.bfloat16, why).startswith("bf16 weights -> fp32 compute (upcast")


def test_a_forced_path_the_cpu_cannot_run_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match=r"--cpu-matmul onednn: oneDNN cannot run bfloat16 linears on this CPU "
                                         r"\(AMD EPYC \(x86_64/avx2.*use --cpu-matmul auto, plain or float32"):
        cpu_matmul.choose("onednn", torch.bfloat16, AVX2, caps(False), 64, 128)
    assert cpu_matmul.choose("plain", torch.bfloat16, AVX2, caps(False), 64, 128) == ("plain", "forced by --cpu-matmul")
    with pytest.raises(ValueError, match="--cpu-matmul must be one of auto, onednn, plain, float32"):
        DecodeConfig(model_dir=".", cpu_matmul="amx")  # type: ignore[arg-type]


def test_an_avx2_cpu_never_prepacks_and_says_why(capped, tiny_model):
    model_dir = tiny_model("llama", "bfloat16")
    config = load_config(model_dir)
    path, words = cpu_path(DecodeConfig(model_dir=model_dir), config, "bfloat16", False, torch.device("cpu"))
    assert path in ("plain", "float32") and "no native bf16 on this CPU" in words
    with pytest.raises(ValueError, match="--cpu-matmul onednn: oneDNN cannot run bfloat16"):
        cpu_path(DecodeConfig(model_dir=model_dir, cpu_matmul="onednn"), config, "bfloat16", False, torch.device("cpu"))
    _, engine, layout = build_native_engine(DecodeConfig(model_dir=model_dir, cpu_matmul="float32",
                                                         kv_cache_tokens=64))
    assert engine.model.dtype == torch.float32 and layout.dtype == "float32"  # KV auto: the compute dtype
    assert not any(getattr(m, "packed", False) for m in engine.model.modules())
    assert engine.hardware.cpu.family == "x86_64/avx2" and engine.hardware.cpu.cap == "avx2"
    assert engine.hardware.paths["matmuls"].startswith("bf16 weights -> fp32 compute (upcast at load, exact)")


def _hf_logits(model_dir, ids: list[int]) -> torch.Tensor:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]  # [S, V]


def _served_logits(model_dir, path: str, ids: list[int]) -> torch.Tensor:
    from pdserve.kvcache.layout import KvLayout
    from pdserve.server.decode.kv_cache import PagedKvCache

    config = load_config(model_dir)
    model = build_model(config, load_weights(model_dir), dtype=torch.float32 if path == "float32" else torch.bfloat16)
    prepare(model, path)
    cache = PagedKvCache(KvLayout(config.num_layers, config.num_kv_heads, config.head_dim, 4, "float32"), 8)
    with torch.no_grad():
        return model.prefill(torch.tensor(ids), [6, 1, 3, 0, 7], cache).float()  # [S, V]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_float32_fallback_computes_transformers_tokens_on_the_bf16_weights(tiny_model, family):
    """fp32 compute of a bf16 checkpoint is exact: transformers loading it in fp32 gives the same next tokens
    at every position, whatever this CPU's kernels."""
    model_dir = tiny_model(family, "bfloat16")
    ids = list(range(3, 22))
    want, got = _hf_logits(model_dir, ids), _served_logits(model_dir, "float32", ids)
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("path", ["plain", "onednn"])
def test_the_bf16_paths_stay_within_bf16_rounding_of_fp32(tiny_model, path):
    if path == "onednn" and not hardware.torch_probe().onednn_bf16:
        pytest.skip(f"oneDNN cannot run bf16 linears on this CPU ({hardware.cpu().describe()}): it needs AVX-512 "
                    f"BW/VL/DQ or AVX-NE-convert; the tests above check that the fallback is chosen instead")
    model_dir = tiny_model("llama", "bfloat16")
    ids = list(range(3, 22))
    want, got = _served_logits(model_dir, "float32", ids), _served_logits(model_dir, path, ids)
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 0.05 * scale
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.8
