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


def caps(onednn_bf16: bool, onednn_fp32: bool = True) -> hardware.TorchCaps:
    return hardware.TorchCaps(version="x", aten_cpu="AVX2", onednn_bf16=onednn_bf16, onednn_fp16=False,
                              onednn_fp32=onednn_fp32)


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
    bf16 = torch.bfloat16
    assert cpu_matmul.runnable(bf16, caps(True), quantized=False) == ["onednn", "plain", "float32-onednn", "float32"]
    assert cpu_matmul.runnable(bf16, caps(False), quantized=False) == ["plain", "float32-onednn", "float32"]
    assert cpu_matmul.runnable(bf16, caps(False, False), quantized=False) == ["plain", "float32"]
    assert cpu_matmul.runnable(bf16, caps(True), quantized=True) == ["plain", "float32"]
    assert cpu_matmul.runnable(torch.float32, caps(False), quantized=False) == ["onednn", "plain"]
    assert cpu_matmul.runnable(torch.float32, caps(False), quantized=True) == ["plain"]
    assert cpu_matmul.choose("auto", bf16, AMX, caps(True), 64, 128) == ("onednn", "native bf16 on this CPU")
    assert cpu_matmul.choose("auto", torch.float32, AVX2, caps(False), 64, 128, quantized=True) == \
        ("plain", "the only path here")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_elsewhere_auto_takes_the_fastest_measured_path(dtype):
    path, why = cpu_matmul.choose("auto", dtype, AVX2, caps(False), 64, 128)
    assert path in cpu_matmul.runnable(dtype, caps(False), False)
    assert "on this CPU; fastest measured (" in why and f"{path} " in why
    assert why.startswith("no native bf16" if dtype == torch.bfloat16 else "float32 weights")
    assert cpu_matmul.describe("float32", torch.bfloat16, why).startswith("bf16 weights -> fp32 compute (upcast")


def test_a_forced_path_the_cpu_cannot_run_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match=r"--cpu-matmul onednn cannot run for bfloat16 weights on this CPU "
                                         r"\(AMD EPYC \(x86_64/avx2.*needs AVX-512 BW/VL/DQ or AVX-NE-convert\); "
                                         r"it takes plain, float32-onednn, float32 here, or auto"):
        cpu_matmul.choose("onednn", torch.bfloat16, AVX2, caps(False), 64, 128)
    assert cpu_matmul.choose("plain", torch.bfloat16, AVX2, caps(False), 64, 128) == ("plain", "forced by --cpu-matmul")
    with pytest.raises(ValueError, match="--cpu-matmul float32 cannot run for float32 weights"):
        cpu_matmul.choose("float32", torch.float32, AVX2, caps(False), 64, 128)  # nothing to upcast
    with pytest.raises(ValueError, match="--cpu-matmul must be one of auto, onednn, plain, float32, float32-onednn"):
        DecodeConfig(model_dir=".", cpu_matmul="amx")  # type: ignore[arg-type]


def _packed_dtypes(model) -> set[torch.dtype]:
    return {m.weight.dtype for m in model.modules() if getattr(m, "packed", False)}


def test_an_avx2_cpu_never_prepacks_bf16_and_says_why(capped, tiny_model):
    model_dir = tiny_model("llama", "bfloat16")
    config = load_config(model_dir)
    path, words = cpu_path(DecodeConfig(model_dir=model_dir), config, "bfloat16", False, torch.device("cpu"))
    assert path in ("plain", "float32", "float32-onednn") and "no native bf16 on this CPU" in words
    with pytest.raises(ValueError, match="--cpu-matmul onednn cannot run for bfloat16 weights"):
        cpu_path(DecodeConfig(model_dir=model_dir, cpu_matmul="onednn"), config, "bfloat16", False, torch.device("cpu"))
    for forced, packed in (("float32", set()), ("float32-onednn", {torch.float32}), ("plain", set())):
        _, engine, layout = build_native_engine(DecodeConfig(model_dir=model_dir, cpu_matmul=forced, kv_cache_tokens=64))
        compute = torch.bfloat16 if forced == "plain" else torch.float32
        assert engine.model.dtype == compute and layout.dtype == str(compute).removeprefix("torch.")  # KV auto
        assert _packed_dtypes(engine.model) == packed
        assert engine.hardware.cpu.family == "x86_64/avx2" and engine.hardware.cpu.cap == "avx2"
        assert engine.hardware.paths["matmuls"] == cpu_matmul.describe(forced, torch.bfloat16, "forced by --cpu-matmul")


def _hf_logits(model_dir, ids: list[int]) -> torch.Tensor:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]  # [S, V]


def _served_logits(model_dir, path: str, ids: list[int]) -> torch.Tensor:
    from pdserve.kvcache.layout import KvLayout
    from pdserve.server.decode.kv_cache import PagedKvCache

    config = load_config(model_dir)
    upcast = path in cpu_matmul.UPCAST
    model = build_model(config, load_weights(model_dir), dtype=torch.float32 if upcast else torch.bfloat16)
    prepare(model, path)
    cache = PagedKvCache(KvLayout(config.num_layers, config.num_kv_heads, config.head_dim, 4, "float32"), 8)
    with torch.no_grad():
        return model.prefill(torch.tensor(ids), [6, 1, 3, 0, 7], cache).float()  # [S, V]


@pytest.mark.parametrize("path", ["float32", "float32-onednn"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_float32_fallbacks_compute_transformers_tokens_on_the_bf16_weights(tiny_model, family, path):
    """fp32 compute of a bf16 checkpoint is exact: transformers loading it in fp32 gives the same next tokens
    at every position, whatever this CPU's kernels (torch's default sgemm or oneDNN's)."""
    if path in cpu_matmul.PACKED and not hardware.torch_probe().onednn_fp32:
        pytest.skip(f"oneDNN cannot run fp32 linears here ({hardware.cpu().describe()})")
    model_dir = tiny_model(family, "bfloat16")
    ids = list(range(3, 22))
    want, got = _hf_logits(model_dir, ids), _served_logits(model_dir, path, ids)
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
