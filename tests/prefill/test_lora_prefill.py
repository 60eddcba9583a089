"""The prefill tier computes with LoRA adapters: a packed step mixing the base model and two adapters (ranks 8 and 16
with rsLoRA, different target modules) gives each prompt transformers + peft's first token, logprob and KV; base
rows equal what a worker without --enable-lora computes; a prefix cached under one adapter serves no other."""

from __future__ import annotations

import asyncio
from functools import cache

import grpc
import numpy as np
import pytest

from pdserve.kvcache.adapter_key import AdapterKey
from pdserve.server.model.config import load_config
from pdserve.server.model.weights import load_weights
from pdserve.server.prefill.config import PrefillConfig
from pdserve.server.prefill.engine import PrefillEngine
from pdserve.server.prefill.model import load_params
from pdserve.server.prefill.step_compiles import watch
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb
from tests.prefill.test_compiles import compiles
from tests.prefill.test_push import TOKEN, Aborted, Context, Rig, Sink

GREEDY = gen_pb.SamplingParams(max_tokens=4, temperature=0.0, top_p=1.0, top_k=0, logprobs=0)
PROMPTS = {"base": [5, 17, 33, 41, 9, 12, 100, 7, 8, 9, 10],
           "ada": [60, 61, 62, 3, 4, 5, 200, 201, 9, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79],
           "bob": [11, 22, 33, 44, 55, 66, 77]}
KEYS = {"ada": 1, "bob": 2, "cy": 3}


def _engine(path, **kw) -> PrefillEngine:
    config = load_config(path)
    return PrefillEngine(config, load_params(config, load_weights(path)), PrefillConfig(model_dir=path, **kw))


def _steps(engine: PrefillEngine) -> list[list[str]]:
    """Records each step the engine runs: its segments' adapters ("base" for none), in packing order."""
    steps, next_step = [], engine.scheduler.next_step

    def recording():
        step = next_step()
        if step:
            steps.append([s.job.adapter_key.name if s.job.adapter_key else "base" for s in step])
        return step

    engine.scheduler.next_step = recording
    return steps


def _adapter(engine: PrefillEngine, loras, name: str):
    return None if name == "base" else engine.lora.adapter(AdapterKey(KEYS[name], name, str(loras[name])))


@cache
def _peft_model(base: str, adapter: str | None):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, adapter)
    return model.eval()


def _peft(base, adapter, prompt: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """transformers + peft: the last position's log-softmax [V], and k, v [L, T, Hkv, D] (k after RoPE)."""
    import torch

    model = _peft_model(str(base), None if adapter is None else str(adapter))
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
    cache_ = out.past_key_values
    k = np.stack([layer.keys[0].transpose(0, 1).numpy() for layer in cache_.layers])  # [L, T, Hkv, D]
    v = np.stack([layer.values[0].transpose(0, 1).numpy() for layer in cache_.layers])
    return torch.log_softmax(out.logits[0, -1], -1).numpy(), k, v


def _check(got, oracle) -> None:
    logprobs, k, v = oracle
    assert got.first_token == int(np.argmax(logprobs))
    assert got.first_logprob.token_id == got.first_token
    assert got.first_logprob.logprob == pytest.approx(float(logprobs[got.first_token]), abs=1e-4)
    for ours, theirs in ((got.k, k), (got.v, v)):  # fp32 both, to a few ulps of the layer's largest value
        np.testing.assert_allclose(ours, theirs, atol=3e-5 * float(np.abs(theirs).max()), rtol=1e-4)


async def test_a_step_mixing_base_and_two_adapters_gives_each_prompt_peft_results(tiny_loras):
    base, loras = tiny_loras
    engine = _engine(base, enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=16)
    steps = _steps(engine)
    names = ["base", "ada", "bob", "ada", "base"]
    results = await asyncio.gather(*(engine.submit(PROMPTS[n], GREEDY, 0, "float32",
                                                   adapter=_adapter(engine, loras, n)) for n in names))
    assert len(steps) == 1 and sorted(steps[0]) == sorted(names)  # one packed step: base, ada and bob side by side
    assert sorted(engine.lora.resident.values()) == [1, 2]
    for name, got in zip(names, results):
        _check(got, _peft(base, None if name == "base" else loras[name], PROMPTS[name]))
    adapters_changed = {n: results[names.index(n)].first_token for n in ("ada", "bob")}
    for n, first in adapters_changed.items():  # the adapters change the answer (else the test proves nothing)
        plain = _peft(base, None, PROMPTS[n])
        assert first != int(np.argmax(plain[0])) or not np.allclose(results[names.index(n)].k, plain[1], atol=1e-3)

    # the same step on a worker without --enable-lora (every prompt as the base model): base rows agree
    plain = _engine(base)
    assert plain.lora is None and plain.runner.lora is None
    plain_steps = _steps(plain)
    again = await asyncio.gather(*(plain.submit(PROMPTS[n], GREEDY, 0, "float32") for n in names))
    assert len(plain_steps) == 1
    for name, got, want in zip(names, results, again):
        if name == "base":
            assert got.first_token == want.first_token
            np.testing.assert_allclose(got.k, want.k, atol=1e-6, rtol=0)
            np.testing.assert_allclose(got.v, want.v, atol=1e-6, rtol=0)


async def test_more_adapters_than_slots_wait_a_step_and_slots_are_reused(tiny_loras):
    base, loras = tiny_loras
    engine = _engine(base, enable_lora=True, max_loras=1, max_cpu_loras=2, max_lora_rank=16)
    steps = _steps(engine)
    names = ["ada", "bob", "base", "cy"]
    results = await asyncio.gather(*(engine.submit(PROMPTS.get(n, PROMPTS["bob"]), GREEDY, 0, "float32",
                                                   adapter=_adapter(engine, loras, n)) for n in names))
    # shortest first (bob and cy: 7 tokens, base 11, ada 19), one adapter a step: the base prompt rides along
    assert steps == [["bob", "base"], ["cy"], ["ada"]]
    assert list(engine.lora.host) == [AdapterKey(2, "bob", str(loras["bob"])), AdapterKey(3, "cy", str(loras["cy"]))]
    assert list(engine.lora.resident.values()) == [1]
    for name, got in zip(names, results):
        _check(got, _peft(base, None if name == "base" else loras[name], PROMPTS.get(name, PROMPTS["bob"])))


async def test_loading_an_adapter_into_a_slot_compiles_nothing(tiny_loras):
    base, loras = tiny_loras
    engine = _engine(base, enable_lora=True, max_loras=1, max_cpu_loras=3, max_lora_rank=16)
    adapters = [_adapter(engine, loras, n) for n in ("ada", "bob", "cy")]
    with watch() as compiles:
        for adapter in adapters:
            assert engine.lora.slots([None, adapter]) == [0, 1]
    assert compiles == []


async def test_a_prefix_cached_under_one_adapter_serves_no_other(tiny_loras):
    base, loras = tiny_loras
    engine = _engine(base, enable_lora=True, max_loras=2, max_cpu_loras=3, max_lora_rank=16, max_batch_size=1)
    prompt = list(range(40, 90))  # 50 tokens: three full blocks of 16 are cached after the first prefill
    first = await engine.submit(prompt, GREEDY, 0, "float32", adapter=_adapter(engine, loras, "ada"))
    _check(first, _peft(base, loras["ada"], prompt))
    for name in ("bob", "base"):  # the same tokens under another adapter, or none: computed afresh
        got = await engine.submit(prompt, GREEDY, 0, "float32", adapter=_adapter(engine, loras, name))
        assert engine.prefix.hits == 0, name
        _check(got, _peft(base, None if name == "base" else loras[name], prompt))
    again = await engine.submit(prompt, GREEDY, 0, "float32", adapter=_adapter(engine, loras, "ada"))
    assert engine.prefix.hits == 48  # its own adapter's prefix is reused
    _check(again, _peft(base, loras["ada"], prompt))


def test_a_worker_without_lora_refuses_an_adapter_and_lora_flags_are_checked(tiny_loras, tmp_path):
    base, loras = tiny_loras
    with_lora = _engine(base, enable_lora=True, max_loras=1, max_lora_rank=16)
    adapter = _adapter(with_lora, loras, "ada")
    plain = _engine(base)

    async def submit():
        return await plain.submit(PROMPTS["ada"], GREEDY, 0, "float32", adapter=adapter)

    with pytest.raises(ValueError, match="this prefill worker serves no LoRA adapters; start it with --enable-lora"):
        asyncio.run(submit())
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be >= max_loras \(2\)"):
        PrefillConfig(model_dir=tmp_path, enable_lora=True, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="--enable-lora is served by a prefill worker of one process"):
        PrefillConfig(model_dir=tmp_path, enable_lora=True, num_processes=2)


async def test_after_warmup_steps_mixing_adapters_compile_nothing(tiny_loras):
    """Adapters entering and leaving slots, chunked prompts and cached prefixes: the programs warm-up compiled
    (with their LoRA inputs) are the ones every step runs."""
    base, loras = tiny_loras
    engine = _engine(base, enable_lora=True, max_loras=2, max_cpu_loras=3, max_lora_rank=16, max_batch_size=4,
                     max_model_len=64, max_prefill_chunk=32, max_batch_tokens=64)
    engine.warmup()
    before = compiles()
    rng = np.random.default_rng(0)
    names = ["ada", "base", "bob", "cy", "ada", "cy", "base", "bob"]
    prompts = [rng.integers(3, 500, n).tolist() for n in (5, 40, 17, 60, 33, 9, 50, 64)]
    for wave in range(2):  # the second wave hits the prefixes the first cached
        results = await asyncio.gather(*(engine.submit(p, GREEDY, 0, "float32", adapter=_adapter(engine, loras, n))
                                         for n, p in zip(names, prompts)))
        assert [r.k.shape[1] for r in results] == [len(p) for p in prompts]
    assert engine.prefix.hits > 0
    assert compiles() == before, f"{compiles() - before} compilations on the request path"
    for name, prompt, got in zip(names, prompts, results):
        assert got.first_token == int(np.argmax(_peft(base, None if name == "base" else loras[name], prompt)[0]))


async def test_the_prefill_worker_loads_the_requests_adapter_and_its_kv_header_names_it(tiny_loras, tmp_path):
    """A PrefillRequest naming an adapter: loaded from its path, the KV (peft's) reaches a receiver that expects that
    adapter; a receiver expecting another refuses it; a bad path and a worker without --enable-lora are refused."""
    base, loras = tiny_loras
    sink = Sink()
    rig = Rig(base, sink, enable_lora=True, max_loras=1, max_lora_rank=16)
    prompt = PROMPTS["bob"]

    def request(rid: str, name: str, path) -> pb.PrefillRequest:
        r = rig.request(rid, prompt)
        r.lora.CopyFrom(pb.LoraAdapter(name=name, id=KEYS.get(name, 9), path=str(path)))
        return r

    transfer = rig.receiver.expect("r1", 0, TOKEN, len(prompt), lora_name="bob")
    answer = await rig.service.Prefill(request("r1", "bob", loras["bob"]), Context())
    assert await asyncio.wait_for(transfer.done, 30) == answer.first_token_id
    logprobs, k, v = _peft(base, loras["bob"], prompt)
    assert answer.first_token_id == int(np.argmax(logprobs))
    got_k, got_v = sink.assemble(sink.writes, rig.layout, len(prompt))
    np.testing.assert_allclose(got_k, k, atol=3e-5 * float(np.abs(k).max()), rtol=1e-4)
    np.testing.assert_allclose(got_v, v, atol=3e-5 * float(np.abs(v).max()), rtol=1e-4)

    wrong = rig.receiver.expect("r2", 0, TOKEN, len(prompt), lora_name="ada")  # the decode worker decodes with ada
    with pytest.raises(Aborted) as refused:
        await rig.service.Prefill(request("r2", "bob", loras["bob"]), Context())
    assert "KV belongs to its adapter" in refused.value.details
    assert wrong.state.value != "done" and not any(rid == "r2" for rid, _, _ in sink.writes)  # no KV of bob for ada

    with pytest.raises(Aborted) as missing:
        await rig.service.Prefill(request("r3", "nope", tmp_path), Context())
    assert missing.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert missing.value.details == f"Loading lora nope failed: No adapter found for {tmp_path}"

    plain = Rig(base, Sink())
    with pytest.raises(Aborted) as off:
        r = plain.request("r4", prompt)
        r.lora.CopyFrom(pb.LoraAdapter(name="bob", id=2, path=str(loras["bob"])))
        await plain.service.Prefill(r, Context())
    assert off.value.code == grpc.StatusCode.FAILED_PRECONDITION and "start it with --enable-lora" in off.value.details


def test_a_steps_lora_slots_are_packed_per_token_and_travel_with_its_arrays(tiny_model):
    """Each segment's slot fills its tokens (padding and base segments 0); a slice's replay carries the column."""
    from pdserve.server.prefill.scheduler import Segment
    from pdserve.server.prefill.shapes import StepShape
    from pdserve.server.prefill.step_inputs import StepInputs
    from pdserve.server.prefill.step_packing import step_inputs
    from tests.prefill.jobs import Job

    config = load_config(tiny_model("llama"))

    class Prompt(Job):
        token_ids, sampling, sample_index, kv_dtype, context, constraint = [], GREEDY, 0, "float32", None, None

    jobs = [Prompt(name, n) for name, n in (("a", 5), ("base", 3), ("b", 16))]
    for job in jobs:
        job.token_ids = list(range(3, 3 + job.num_tokens))
    step = [Segment(job, 0, job.num_tokens) for job in jobs]
    inputs, offsets = step_inputs(step, StepShape(64, 0), config, np.float32, config.vocab_size, lambda n: 16,
                                  lora_slots=[2, 0, 1])
    assert offsets == [0, 16, 32]
    want = np.zeros((1, 64), np.int32)
    want[0, 0:5], want[0, 32:48] = 2, 1
    np.testing.assert_array_equal(inputs.lora_slots, want)
    back = StepInputs.from_arrays(inputs.arrays(), inputs.formats)
    np.testing.assert_array_equal(back.lora_slots, want)
    plain, _ = step_inputs(step, StepShape(64, 0), config, np.float32, config.vocab_size, lambda n: 16)
    assert plain.lora_slots is None and "lora_slots" not in plain.arrays()


async def test_bfloat16_adapters_serve_an_fp32_model_close_to_peft(tiny_loras):
    """--lora-dtype bfloat16: the slots hold bf16 matrices (half the bytes), the first token still peft's."""
    base, loras = tiny_loras
    engine = _engine(base, enable_lora=True, max_loras=1, max_lora_rank=16, lora_dtype="bfloat16")
    a, _ = next(iter(engine.lora.stacks[0].values()))
    assert str(a.dtype) == "bfloat16"
    got = await engine.submit(PROMPTS["ada"], GREEDY, 0, "float32", adapter=_adapter(engine, loras, "ada"))
    assert got.first_token == int(np.argmax(_peft(base, loras["ada"], PROMPTS["ada"])[0]))
