"""Structured output on the decode tier: every token under its sequence's grammar, at temperature 1, beside
unconstrained sequences that keep their exact tokens, through preemption and a migration's replay."""

from __future__ import annotations

import asyncio
import json
import re

import torch

from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb
from pdserve.server.decode.sampling import SamplingBatch
from pdserve.server.model.config import load_config
from pdserve.server.model.tokenizer import Tokenizer
from pdserve.server.structured.bitmask import allowed_ids
from pdserve.server.structured.grammars import Grammars
from tests.decode.test_engine import _all_back, _drain, _engine, _greedy, _hf_greedy

REGEX = "[ab]{2,5}x"


def _grammars(path) -> Grammars:
    config = load_config(path)
    return Grammars.for_model(path, config.vocab_size, tuple(config.eos_token_ids))


def _sampled(max_tokens: int, seed: int, **structured) -> gen_pb.SamplingParams:
    return gen_pb.SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=1.0, top_k=0, seed=seed,
                                 structured=gen_pb.StructuredOutput(**structured))


async def _run(engine, rid: str, prompt: list[int], sampling: gen_pb.SamplingParams, prior: list[int] = ()):
    request = pb.DecodeRequest(request_id=rid, prompt_token_ids=[*prompt, *prior], sampling=sampling,
                               num_output_tokens=len(prior), local_prefill=True)
    seq = engine.add(request)
    await seq.admitted
    engine.start(seq, await engine.prefill_locally(seq))
    return seq


async def test_constrained_rows_follow_their_grammar_and_free_rows_keep_their_tokens(tiny_model):
    path = tiny_model("qwen2")
    tok = Tokenizer.from_dir(path)
    engine = _engine(path, num_blocks=64, grammars=_grammars(path))
    free = await _run(engine, "free", [5, 6, 7], _greedy(12))
    regexes = [await _run(engine, f"re{i}", [9, 10 + i], _sampled(32, i, regex=REGEX)) for i in range(4)]
    choice = await _run(engine, "choice", [11], _sampled(32, 7, choice=gen_pb.Choices(choices=["yes", "no"])))
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}}, "required": ["n", "ok"],
              "additionalProperties": False}
    objects = [await _run(engine, f"js{i}", [12, i], _sampled(48, 100 + i, json_schema=json.dumps(schema)))
               for i in range(3)]
    outs = await asyncio.gather(*(_drain(s) for s in [free, *regexes, choice, *objects]))
    assert free.output_ids == _hf_greedy(path, [5, 6, 7], 12)
    for seq in [*regexes, choice, *objects]:
        assert seq.finish_reason == gen_pb.FINISH_REASON_STOP, seq.request_id
    for seq in regexes:
        assert re.fullmatch(REGEX, tok.decode(seq.output_ids)), tok.decode(seq.output_ids)
    assert tok.decode(choice.output_ids) in ("yes", "no")
    for seq in objects:
        value = json.loads(tok.decode(seq.output_ids))
        assert set(value) == {"n", "ok"} and 0 <= value["n"] <= 99 and isinstance(value["ok"], bool)
    assert len(outs) == 9 and _all_back(engine)
    await engine.close()


async def test_the_batch_mask_is_all_ones_for_free_rows_and_none_without_constraints(tiny_model):
    path = tiny_model("qwen2")
    engine = _engine(path, num_blocks=16, grammars=_grammars(path))
    free = engine.add(pb.DecodeRequest(request_id="f", prompt_token_ids=[1, 2], sampling=_greedy(4)))
    choice = engine.add(pb.DecodeRequest(request_id="c", prompt_token_ids=[1, 2],
                                         sampling=_sampled(4, 0, choice=gen_pb.Choices(choices=["yes", "no"]))))
    assert SamplingBatch.of([free], 512).bitmask is None
    masks = SamplingBatch.of([free, choice], 512).bitmask
    assert masks.dtype == torch.int32 and masks.shape == (2, 16)
    assert allowed_ids(masks[0].numpy(), 512) == list(range(512))
    tok = Tokenizer.from_dir(path)
    allowed = allowed_ids(masks[1].numpy(), 512)
    assert allowed and all("yes".startswith(t) or "no".startswith(t) for t in map(lambda i: tok.decode([i]), allowed))
    await engine.close()


async def test_preempted_constrained_sequences_resume_under_their_grammar(tiny_model):
    path = tiny_model("qwen2")
    tok = Tokenizer.from_dir(path)
    # 6 blocks of 4 tokens for three sequences of up to 5 + 16 tokens: they take turns, preempted.
    engine = _engine(path, num_blocks=6, enable_prefix_caching=False, grammars=_grammars(path))
    pattern = "[a-z]{14}x"
    seqs = [await _run(engine, f"p{i}", [5 + i, 6, 7, 8, 9], _sampled(16, i, regex=pattern)) for i in range(3)]
    await asyncio.gather(*(_drain(s) for s in seqs))
    assert engine.scheduler.num_preemptions >= 1  # how many depends on how the loop interleaves the admissions
    for seq in seqs:
        assert seq.finish_reason == gen_pb.FINISH_REASON_STOP
        assert re.fullmatch(pattern, tok.decode(seq.output_ids)), tok.decode(seq.output_ids)
    assert _all_back(engine)
    await engine.close()


async def test_a_migrated_request_replays_its_outputs_and_completes_the_grammar(tiny_model):
    path = tiny_model("qwen2")
    tok = Tokenizer.from_dir(path)
    engine = _engine(path, num_blocks=32, grammars=_grammars(path))
    prior = tok.encode('{"n":')  # what the dead worker sent already
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    seq = await _run(engine, "m", [3, 4], _sampled(24, 5, json_schema=json.dumps(schema)), prior=prior)
    await _drain(seq)
    assert seq.finish_reason == gen_pb.FINISH_REASON_STOP
    assert 0 <= json.loads(tok.decode(prior + seq.output_ids))["n"] <= 9
    await engine.close()


async def test_outputs_the_grammar_refuses_are_refused_at_add(tiny_model):
    path = tiny_model("qwen2")
    tok = Tokenizer.from_dir(path)
    engine = _engine(path, num_blocks=16, grammars=_grammars(path))
    request = pb.DecodeRequest(request_id="bad", prompt_token_ids=[3, *tok.encode("zz")], num_output_tokens=2,
                               sampling=_sampled(8, 0, regex="[ab]+"))
    try:
        engine.add(request)
        raise AssertionError("added")
    except ValueError as e:
        assert "do not fit the grammar" in str(e)
    no_grammars = _engine(path, num_blocks=16)
    try:
        no_grammars.add(pb.DecodeRequest(request_id="x", prompt_token_ids=[3], sampling=_sampled(8, 0, regex="a")))
        raise AssertionError("added")
    except ValueError as e:
        assert str(e).startswith("sampling.structured: ")
    await engine.close()
    await no_grammars.close()
