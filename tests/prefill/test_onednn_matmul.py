"""The onednn-bf16 prefill path (weights prepacked on the torch side, activations through a host callback)
computes what the XLA paths and transformers compute; an AVX2-only machine falls back to XLA."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.server import hardware
from pdserve.server.model.config import load_config
from pdserve.server.model.weights import load_weights
from pdserve.server.prefill.config import PrefillConfig
from pdserve.server.prefill.main import load_engine
from pdserve.server.prefill import onednn_native
from pdserve.server.prefill.matmul import OnednnWeights, Resident, contraction
from pdserve.server.prefill.model import forward_logits, load_params

GREEDY = gen_pb.SamplingParams(max_tokens=1, temperature=0.0)
needs_onednn = pytest.mark.skipif(not hardware.torch_probe().onednn_bf16,
                                  reason="oneDNN runs no bf16 linear on this CPU (the XLA paths serve it)")


def _ids(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 200, n).astype(np.int32)


def test_the_contraction_of_each_spec_the_model_uses():
    assert contraction("bsh,hnd->bsnd", 3, 3) == 1
    assert contraction("bsnd,ndh->bsh", 4, 3) == 2
    assert contraction("bsi,ih->bsh", 3, 2) == 1
    with pytest.raises(ValueError, match="trailing axes"):
        contraction("bsh,nhd->bsnd", 3, 3)


@needs_onednn
@pytest.mark.parametrize("family,host_attention,native", [
    ("llama", True, True), ("qwen2", True, True), ("qwen2", False, True), ("qwen3", True, True),
    ("mistral-windowed", True, True), ("gemma3", True, True), ("qwen2", True, False), ("gemma3", True, False)])
def test_onednn_logits_match_transformers_bf16_and_xla_bf16(tiny_model, monkeypatch, family, host_attention, native):
    """Packed q/k/v (Qwen2's biases after it), the fused MLP (silu; Gemma's tanh gelu), the host's attention (sliding
    windows that cut: the tiny Mistral's and Gemma 3's window is shorter than the prompt); called from C++
    (onednn_native.py), or `native` False, through Python (host_call.py) as where that library is not built."""
    if not native:
        monkeypatch.setattr(onednn_native, "load", lambda: "as where the library is not built")
    path = tiny_model(family, "bfloat16")
    config = load_config(path)
    params = load_params(config, load_weights(path), dtype="bfloat16")
    bank = OnednnWeights(threads=1)
    assert bank.without_python == native
    held = dict(params, layers=bank.take(params["layers"]))
    assert isinstance(held["layers"]["w_up"], Resident) and held["layers"]["w_up"].ids.shape == (config.num_layers,)
    hq, hkv = config.num_heads, config.num_kv_heads
    assert held["layers"]["wqkv"].shape == (config.hidden_size, hq + 2 * hkv, config.head_dim)
    assert not {"wq", "wk", "wv"} & set(held["layers"])
    assert bank.nbytes == sum(np.asarray(params["layers"][n]).size * 2 for n in
                              ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"))
    ids = _ids(13 if family in ("llama", "qwen2", "qwen3") else 40, seed=5)
    if config.layer_windows:
        assert min(w for w in config.layer_windows if w) < len(ids)
    kernels = bank.kernels(host_attention=host_attention)
    got = np.asarray(jax.jit(lambda p, t: forward_logits(p, t, config=config, matmul=kernels))(
        held, jnp.asarray(ids[None])))[0]
    xla = np.asarray(forward_logits(params, jnp.asarray(ids[None]), config=config))[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        want = hf(torch.tensor(ids[None].astype(np.int64))).logits[0].float().numpy()
    # bf16 operands, fp32 accumulation on every side: no further from XLA's bf16 path than bf16 rounding takes it
    # from transformers (0.02 at 13 tokens, test_model.py's bound; 40 tokens through windows and gelu round more),
    # and as close to transformers as XLA's bf16 path is
    xla_off = np.abs(xla - want).max()
    assert np.abs(got - xla).max() < max(0.02, xla_off)
    assert np.abs(got - want).max() < max(0.05, 1.25 * xla_off)
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.8


def _compiled_matmul(bank: OnednnWeights, w: Resident, x: jax.Array):
    return jax.jit(lambda x, ids: bank.matmul("bsh,hn->bsn", x, Resident(ids, w.shape))).lower(x, w.ids[0]).compile()


@needs_onednn
def test_a_released_banks_weights_are_never_read():
    """A program compiled against a bank (or read from the compilation cache) fails, naming the weight, once the
    bank is gone: its ids are released on the C++ side, never reused."""
    bank = OnednnWeights(threads=1)
    assert bank.without_python, onednn_native.load()
    w = bank.hold(np.ones((1, 8, 4), np.float32), 1)  # one layer's [K 8, N 4]
    x = jnp.ones((1, 3, 8), jnp.bfloat16)
    matmul = _compiled_matmul(bank, w, x)
    assert np.asarray(matmul(x, w.ids[0]), np.float32).tolist() == [[[8.0] * 4] * 3]
    del bank
    gc.collect()
    with pytest.raises(Exception, match=f"weight {int(w.ids[0])} is not held here"):
        jax.block_until_ready(matmul(x, w.ids[0]))


@needs_onednn
def test_a_served_onednn_engine_answers_as_the_xla_bf16_one(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    path = tiny_model("qwen2", "bfloat16")
    settings = dict(model_dir=path, max_batch_size=1, max_model_len=64, compilation_cache="none")
    onednn = load_engine(PrefillConfig(prefill_matmul="onednn-bf16", **settings), progress=False)
    xla = load_engine(PrefillConfig(prefill_matmul="xla-bf16", **settings), progress=False)
    assert isinstance(onednn.runner.group_layers[0]["wqkv"], Resident)
    assert onednn.matmul_path == "onednn-bf16 (forced by --prefill-matmul)"
    assert onednn.attention_path.split(" ")[0] in ("host", "xla") and "fastest measured" in onednn.attention_path
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    prompts = [_ids(11 + seed * 7, seed).tolist() for seed in range(3)]

    async def both():
        return [(await onednn.submit(ids, GREEDY, 0, "bfloat16"), await xla.submit(ids, GREEDY, 0, "bfloat16"))
                for ids in prompts]

    for ids, (got, want) in zip(prompts, asyncio.run(both())):
        assert str(got.k.dtype) == "bfloat16" and got.k.shape == want.k.shape
        np.testing.assert_allclose(np.asarray(got.k, np.float32), np.asarray(want.k, np.float32), atol=0.05)
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
        top2 = torch.topk(logits, 2).values
        if top2[0] - top2[1] > 0.05:  # a clear winner: every bf16 path must pick it
            assert got.first_token == want.first_token == int(logits.argmax())


@needs_onednn
@pytest.mark.parametrize("family", ["qwen2", "mistral-windowed"])
def test_packed_and_chunked_prompts_on_the_host_attention_answer_as_xla_bf16(tiny_model, tmp_path, monkeypatch,
                                                                            family):
    """Several prompts packed into one step, and prompts longer than --max-prefill-chunk (each later chunk reads the
    earlier chunks' KV as context keys), with the host's attention forced: the same first tokens and KV as the
    xla-bf16 engine, whose attention is XLA's."""
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    path = tiny_model(family, "bfloat16")
    settings = dict(model_dir=path, max_batch_size=4, max_model_len=64, max_prefill_chunk=16, compilation_cache="none")
    onednn = load_engine(PrefillConfig(prefill_matmul="onednn-bf16", prefill_attention="host", **settings),
                         progress=False)
    xla = load_engine(PrefillConfig(prefill_matmul="xla-bf16", **settings), progress=False)
    assert onednn.attention_path == "host (forced by --prefill-attention)"
    prompts = [_ids(n, seed).tolist() for seed, n in enumerate((5, 9, 37, 12))]

    async def together():  # submitted at once: packed into shared steps, the 37-token one in 3 chunks
        return [await asyncio.gather(*(engine.submit(ids, GREEDY, 0, "bfloat16") for ids in prompts))
                for engine in (onednn, xla)]

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    for ids, got, want in zip(prompts, *asyncio.run(together())):
        assert got.k.shape == want.k.shape
        np.testing.assert_allclose(np.asarray(got.k, np.float32), np.asarray(want.k, np.float32), atol=0.05)
        np.testing.assert_allclose(np.asarray(got.v, np.float32), np.asarray(want.v, np.float32), atol=0.05)
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
        top2 = torch.topk(logits, 2).values
        if top2[0] - top2[1] > 0.05:
            assert got.first_token == want.first_token == int(logits.argmax())


def test_host_attention_beside_xla_matmuls_is_refused(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    settings = dict(model_dir=tiny_model("llama", "bfloat16"), max_batch_size=1, max_model_len=64,
                    compilation_cache="none")
    with pytest.raises(ValueError, match="--prefill-attention host runs beside --prefill-matmul onednn-bf16.*pass "
                                         "--prefill-attention auto or xla"):
        load_engine(PrefillConfig(prefill_matmul="xla-bf16", prefill_attention="host", **settings), progress=False)


def test_auto_on_an_fp32_checkpoint_stays_fp32_and_exact(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    path = tiny_model("llama")
    engine = load_engine(PrefillConfig(model_dir=path, max_batch_size=1, max_model_len=64, compilation_cache="none"),
                         progress=False)
    assert engine.matmul_path.startswith("xla-fp32 (the only exact path for float32 weights")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [_ids(9 + seed, seed) for seed in range(3)]

    async def firsts():
        return [(await engine.submit(ids.tolist(), GREEDY, 0, "float32")).first_token for ids in prompts]

    with torch.no_grad():
        want = [int(hf(torch.tensor(ids[None].astype(np.int64))).logits[0, -1].argmax()) for ids in prompts]
    assert asyncio.run(firsts()) == want
    assert not (tmp_path / "prefill-matmul.json").exists()  # nothing measured, nothing cached


_AVX2_CHILD = """
import json, logging, sys
from pdserve.server import hardware
hardware.apply_cpu_cap()
from pdserve.server.prefill.config import PrefillConfig
from pdserve.server.prefill.main import load_engine
settings = dict(model_dir=sys.argv[1], max_batch_size=1, max_model_len=64, compilation_cache="none")
try:
    load_engine(PrefillConfig(prefill_matmul="onednn-bf16", **settings), progress=False)
    refused = ""
except ValueError as e:
    refused = str(e)
engine = load_engine(PrefillConfig(**settings), progress=False)
cache = json.loads(open(sys.argv[2] + "/prefill-matmul.json").read())
print(json.dumps({"refused": refused, "path": engine.matmul_path, "onednn": hardware.torch_probe().onednn_bf16,
                  "cached": [e["path"] for e in cache.values()], "timed": [sorted(e["timings"]) for e in cache.values()]}))
"""


def test_an_avx2_only_machine_measures_the_xla_paths_and_refuses_onednn(tiny_model, tmp_path):
    """PDSERVE_CPU_ISA=avx2 caps oneDNN (hardware.apply_cpu_cap): the oneDNN path is no candidate, forcing it is
    refused naming the flag, and auto measures and picks one of the XLA paths."""
    env = dict(os.environ, PDSERVE_CPU_ISA="avx2", PDSERVE_CACHE=str(tmp_path))
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    env.pop("XLA_FLAGS", None)
    out = subprocess.run([sys.executable, "-c", _AVX2_CHILD, str(tiny_model("llama", "bfloat16")), str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["onednn"] is False
    assert "--prefill-matmul onednn-bf16 cannot run: oneDNN runs no bf16 linear here" in found["refused"]
    assert found["path"].split(" ")[0] in ("xla-fp32", "xla-bf16") and "fastest measured" in found["path"]
    assert found["timed"] == [["xla-bf16", "xla-fp32"]]
    assert found["cached"] == [found["path"].split(" ")[0]]


NO_COMPILER = r"""
import asyncio, json, logging, sys
import numpy as np
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.server.prefill.config import PrefillConfig
from pdserve.server.prefill.main import load_engine
from pdserve.server.prefill import host_call, onednn_native
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
engine = load_engine(PrefillConfig(model_dir=sys.argv[1], max_batch_size=1, max_model_len=64, compilation_cache="none",
                                   prefill_matmul="onednn-bf16", prefill_attention="host"), progress=False)
ids = np.random.default_rng(3).integers(3, 200, 21).tolist()
done = asyncio.run(engine.submit(ids, gen_pb.SamplingParams(max_tokens=1, temperature=0.0), 0, "bfloat16"))
print(json.dumps({"token": done.first_token, "native": onednn_native.load(), "host_call": host_call.load()}))
"""


@needs_onednn
def test_without_a_cxx_compiler_the_onednn_engine_calls_through_python_and_answers_the_same(tiny_model, tmp_path):
    """No C++ compiler (and no built library): the host calls run as Python callbacks, the start-up says why, and
    the engine's first token is the C++ path's."""
    path = tiny_model("qwen2", "bfloat16")
    done = subprocess.run([sys.executable, "-c", NO_COMPILER, str(path)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PDSERVE_CACHE": str(tmp_path / "cache"), "CXX": str(tmp_path / "no-c++"),
                               "PDSERVE_KERNEL_CACHE": str(tmp_path / "kernels")})
    assert done.returncode == 0, done.stderr[-2000:]
    python = json.loads(done.stdout.strip().splitlines()[-1])
    assert "no C++ compiler" in python["native"] and "no C++ compiler" in python["host_call"]
    assert "run through Python (under the GIL)" in done.stderr and "compile at every start" in done.stderr
    config = load_config(path)
    params = load_params(config, load_weights(path), dtype="bfloat16")
    bank = OnednnWeights(threads=1)
    assert bank.without_python, onednn_native.load()
    held = dict(params, layers=bank.take(params["layers"]))
    ids = np.random.default_rng(3).integers(3, 200, 21)
    logits = np.asarray(forward_logits(held, jnp.asarray(ids[None]), config=config,
                                       matmul=bank.kernels(host_attention=True)))[0, -1]
    top2 = np.sort(logits)[-2:]
    assert python["token"] in np.argsort(logits)[-2:].tolist()
    if top2[1] - top2[0] > 0.05:  # a clear winner: both paths must pick it
        assert python["token"] == int(logits.argmax())
