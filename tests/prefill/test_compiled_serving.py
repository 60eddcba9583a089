"""Right after ready, with only the first set compiled (warmup.py), long prompts are served from it: a
second turn's suffix runs in chunks of the one compiled context shape, penalized sampling pads to its one
compiled shape, fp8/int8 KV for the wire is quantized on the host until its programs compile, and nothing
compiles on the request path (JAX's own compile events, and `pdserve_prefill_compile_waits`), with the first
tokens transformers' and the KV of an engine that compiles every shape."""

from __future__ import annotations

import asyncio

import numpy as np
import torch
import transformers
from prometheus_client import REGISTRY

from pdserve.kvcache.quant import dequantize as kv_dequantize
from pdserve.kvcache.quant import error_bound
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.server.model.config import load_config
from pdserve.server.model.weights import load_weights
from pdserve.server.prefill import warmup as warmup_module
from pdserve.server.prefill.config import PrefillConfig
from pdserve.server.prefill.engine import PrefillEngine
from pdserve.server.prefill.model import load_params
from pdserve.server.prefill.shapes import StepShape
from pdserve.server.prefill.warmup import Warmup
from tests.prefill.test_compiles import compiles

GREEDY = gen_pb.SamplingParams(max_tokens=4, temperature=0.0)
PENALIZED = gen_pb.SamplingParams(max_tokens=4, temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5)


def _compile_waits() -> float:
    """pdserve_prefill_compile_waits_total, whatever model and role the process named itself."""
    return sum(s.value for m in REGISTRY.collect() if m.name == "pdserve_prefill_compile_waits"
               for s in m.samples if s.name.endswith("_total"))


async def _steps_done(engine: PrefillEngine, steps: int) -> None:
    """Waits until the engine's loop has counted `steps` steps (a prompt's answer comes before its step ends)."""
    for _ in range(500):
        if engine.batches >= steps:
            break
        await asyncio.sleep(0.01)
    assert engine.batches == steps


async def test_long_prompts_right_after_ready_run_in_the_first_set_and_compile_nothing(tiny_model, monkeypatch):
    monkeypatch.setattr(warmup_module, "CONTEXT_CHUNK", 64)  # the context shape: 64 token slots
    path = tiny_model("llama")
    model_config = load_config(path)
    params = load_params(model_config, load_weights(path))
    config = PrefillConfig(model_dir=path, max_batch_size=4, max_model_len=512)
    engine = PrefillEngine(model_config, params, config)
    warmup = Warmup(engine)
    warmup.compile(warmup.first("common"), threads=2)
    engine.compiling = warmup  # ready; the background is not started: the first set is all there is
    assert engine.token_buckets == [16, 32, 64, 128, 256, 512, 1024, 2048] and engine.context_buckets == [0, 256, 512]
    assert warmup.compiled.steps == {StepShape(t, 0) for t in engine.token_buckets} | {StepShape(64, 512)}
    assert warmup.compiled.penalized == {(4, 512)}

    rng = np.random.default_rng(5)
    turn1 = rng.integers(3, 500, 200).tolist()
    turn2 = turn1 + rng.integers(3, 500, 290).tolist()  # its first 192 tokens (12 blocks) come from the prefix KV
    other = rng.integers(3, 500, 300).tolist()
    before, waits = compiles(), _compile_waits()
    got = [await engine.submit(turn1, GREEDY, 0, "float32"), await engine.submit(turn2, GREEDY, 0, "float32"),
           await engine.submit(other, PENALIZED, 0, "float32")]
    await _steps_done(engine, 1 + 5 + 1)
    assert compiles() == before, f"{compiles() - before} compilations on the request path"
    assert _compile_waits() == waits
    assert engine.prefix.hits == 192
    # turn1 in one step; turn2's 298 new tokens in 64-token chunks reading up to 448 tokens of context
    # (padded to 512); the penalized prompt in one step, its sampling padded to 4 rows of 512 tokens
    assert engine._shapes_run == {StepShape(256, 0), StepShape(64, 512), StepShape(512, 0)}
    assert warmup.pending == len(warmup.jobs) - len(warmup.first("common"))  # nothing compiled meanwhile
    assert warmup.asked[StepShape(512, 256)] == 1 and warmup.asked[("penalized", 1, 512)] == 1

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [int(hf(torch.tensor([p])).logits[0, -1].argmax()) for p in (turn1, turn2)]
    assert [r.first_token for r in got[:2]] == want

    reference = PrefillEngine(model_config, params, config)  # every shape (each compiles on its first step)
    expected = [await reference.submit(p, s, 0, "float32") for p, s in ((turn1, GREEDY), (turn2, GREEDY),
                                                                         (other, PENALIZED))]
    await _steps_done(reference, 3)
    assert _compile_waits() == waits + 3  # the counter counts: each of its steps compiled its programs
    assert [r.first_token for r in got] == [r.first_token for r in expected]
    assert reference._shapes_run == {StepShape(256, 0), StepShape(512, 256), StepShape(512, 0)}
    for g, w in zip(got, expected, strict=True):
        np.testing.assert_allclose(g.k, w.k, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(g.v, w.v, rtol=1e-5, atol=1e-5)


async def test_a_prompt_no_compiled_shape_holds_runs_once_the_background_compiles_one(tiny_model, monkeypatch):
    monkeypatch.setattr(warmup_module, "CONTEXT_CHUNK", 16)  # the context shape holds no 32-token block
    path = tiny_model("llama")
    model_config = load_config(path)
    params = load_params(model_config, load_weights(path))
    config = PrefillConfig(model_dir=path, max_batch_size=2, max_model_len=256)
    engine = PrefillEngine(model_config, params, config)
    warmup = Warmup(engine)
    warmup.compile(warmup.first("common"), threads=2)
    engine.compiling = warmup
    assert {s for s in warmup.compiled.steps if s.context} == {StepShape(16, 256)}
    rng = np.random.default_rng(6)
    turn1 = rng.integers(3, 500, 100).tolist()
    turn2 = turn1 + rng.integers(3, 500, 50).tolist()
    first = await engine.submit(turn1, GREEDY, 0, "float32", block_size=32)
    job = engine.enqueue(turn2, GREEDY, 0, "float32", block_size=32)  # 96 tokens cached: 54 to run with context
    await asyncio.sleep(0.3)
    assert not job.started.done()  # waits: no compiled shape holds a block of it beside its context
    warmup.start()  # the shape it asked for compiles first
    second = await asyncio.wait_for(job.first_token, 300)
    warmup.stop()
    assert StepShape(64, 256) in warmup.compiled.steps
    reference = PrefillEngine(model_config, params, config)
    want = [(await reference.submit(p, GREEDY, 0, "float32", block_size=32)).first_token for p in (turn1, turn2)]
    assert [first.first_token, second] == want


async def test_fp8_and_int8_kv_right_after_ready_is_quantized_on_the_host_while_its_programs_compile(tiny_model):
    path = tiny_model("llama")
    model_config = load_config(path)
    params = load_params(model_config, load_weights(path))
    config = PrefillConfig(model_dir=path, max_batch_size=2, max_model_len=256, prefix_cache_bytes=0)
    engine = PrefillEngine(model_config, params, config)
    warmup = Warmup(engine)
    warmup.compile(warmup.first("common"), threads=2)
    engine.compiling = warmup
    prompt = np.random.default_rng(7).integers(3, 500, 100).tolist()
    waits = _compile_waits()
    got = {fmt: await engine.submit(prompt, GREEDY, 0, fmt, block_size=16) for fmt in ("fp8_e4m3", "int8")}
    await _steps_done(engine, 2)
    assert _compile_waits() == waits  # the wire formats compile on a thread of their own, not the step's
    for fmt in got:  # the step's shape (128 slots) in each format, compiled beside it
        await asyncio.wait_for(asyncio.wrap_future(engine._wire_compiles[128, (fmt, 16)]), 300)
        assert engine.runner.wire_compiled(128, (fmt, 16))
    after = {fmt: await engine.submit(prompt, GREEDY, 0, fmt, block_size=16) for fmt in got}  # on the device now
    await _steps_done(engine, 4)
    assert _compile_waits() == waits
    exact = await engine.submit(prompt, GREEDY, 0, "float32")
    for fmt, host in got.items():
        device = after[fmt]
        assert host.first_token == device.first_token == exact.first_token
        assert host.k.dtype == device.k.dtype and host.k_scales.shape == device.k_scales.shape == (2, 7, 2)
        # the numpy reference against XLA: scales to 1 ulp, the quantized values all but a few equal
        np.testing.assert_allclose(host.k_scales, device.k_scales, rtol=2.5e-7, atol=0)
        np.testing.assert_allclose(host.v_scales, device.v_scales, rtol=2.5e-7, atol=0)
        for h, d, x, scales in ((host.k, device.k, exact.k, host.k_scales), (host.v, device.v, exact.v, host.v_scales)):
            assert np.mean(h.view(np.int8) == d.view(np.int8)) > 0.99
            got_x = kv_dequantize(h, scales, 16)
            assert np.all(np.abs(got_x - x) <= error_bound(x, scales, 16, fmt))
