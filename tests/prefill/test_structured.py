"""The first token under its grammar's mask on the prefill tier: in the jitted sampler (masks are data, all
ones for free rows, so one program serves both), packed by step_packing, through the engine."""

from __future__ import annotations

import asyncio
import re

import jax.numpy as jnp
import numpy as np
from pdserve.server.model.config import load_config
from pdserve.server.model.tokenizer import Tokenizer
from pdserve.server.prefill.sampler import sample_jit
from pdserve.server.prefill.step_packing import sampling_columns
from pdserve.server.structured.bitmask import allowed_ids, unconstrained
from pdserve.server.structured.grammars import Grammars
from pdserve.v1 import generation_pb2 as gen_pb

from tests.prefill.test_engine import _engine
from tests.structured.vocab import WIDTH, grammars


def _sample(logits: np.ndarray, masks: np.ndarray, temperature: float, seeds) -> list[int]:
    n = logits.shape[0]
    out = sample_jit(jnp.asarray(logits), jnp.full((n,), temperature, jnp.float32), jnp.zeros(n, jnp.int32),
                     jnp.ones(n, jnp.float32), jnp.asarray(seeds, jnp.uint32), jnp.zeros(n, jnp.int32),
                     jnp.zeros(n, jnp.float32), jnp.asarray(masks))
    return np.asarray(out).tolist()


def test_the_mask_keeps_exactly_its_ids_and_all_ones_changes_nothing():
    logits = np.random.default_rng(0).normal(size=(4, 70)).astype(np.float32)  # [B, V], 3 words a row
    masks = unconstrained(4, 70)
    masks[1:] = 0
    masks[1, 0] = 1 << 5
    masks[2, 1] = (1 << 0) | (1 << 9)  # ids 32, 41
    masks[3, 2] = 1 << 5  # id 69, the last
    assert _sample(logits, masks, 0.0, [0] * 4) == [int(logits[0].argmax()), 5, 32 if logits[2, 32] > logits[2, 41] else 41, 69]
    draws = [_sample(logits, masks, 1.0, [s] * 4) for s in range(40)]
    assert {d[1] for d in draws} == {5} and {d[2] for d in draws} <= {32, 41} and {d[3] for d in draws} == {69}
    assert len({d[0] for d in draws}) > 5  # the free row samples the whole vocabulary


def test_sampling_columns_carry_each_jobs_first_mask():
    class Job:
        def __init__(self, constraint):
            self.sampling = gen_pb.SamplingParams(temperature=1.0, seed=3)
            self.sample_index = 0
            self.constraint = constraint

    g = grammars()
    regex = g.constraint(gen_pb.StructuredOutput(regex="(ab)+x"))
    replayed = g.constraint(gen_pb.StructuredOutput(regex="(ab)+x"))
    replayed.replay([3])  # a migration's output so far: "ab"
    columns = sampling_columns([Job(None), Job(regex), Job(replayed)], 4, WIDTH)
    masks = columns[-1]
    assert masks.dtype == np.int32 and masks.shape == (4, 2)
    assert [allowed_ids(m, WIDTH) for m in masks] == [list(range(WIDTH)), [3], [1, 3, 9], list(range(WIDTH))]


async def test_the_engines_first_token_obeys_the_grammar_beside_free_prompts(tiny_model):
    path = tiny_model("qwen2")
    config = load_config(path)
    tok = Tokenizer.from_dir(path)
    g = Grammars.for_model(path, config.vocab_size, tuple(config.eos_token_ids))
    engine = _engine(path)
    greedy = gen_pb.SamplingParams(max_tokens=4, temperature=0.0, top_p=1.0)
    hot = [gen_pb.SamplingParams(max_tokens=4, temperature=1.0, top_p=1.0, seed=s) for s in range(6)]
    brace = gen_pb.StructuredOutput(regex=r"\{")
    word = gen_pb.StructuredOutput(regex="[a-c]+z")
    free = [3, 4, 5, 6]
    results = await asyncio.gather(
        engine.submit(free, greedy, 0, "float32"),
        *(engine.submit([7, i], hot[i], 0, "float32", constraint=g.constraint(brace)) for i in range(3)),
        *(engine.submit([8, i], hot[3 + i], 0, "float32", constraint=g.constraint(word)) for i in range(3)),
    )
    alone = await _engine(path, max_batch_size=1).submit(free, greedy, 0, "float32")
    assert results[0].first_token == alone.first_token
    assert [r.first_token for r in results[1:4]] == [tok.encode("{")[0]] * 3
    for r in results[4:]:
        assert re.fullmatch("[a-c]+", tok.decode([r.first_token])), tok.decode([r.first_token])


async def test_the_service_replays_a_migrations_outputs_and_refuses_what_cannot_be_enforced():
    from types import SimpleNamespace

    import pytest
    from pdserve.server.prefill.service import PrefillService
    from pdserve.server.structured.output_spec import SpecError
    from pdserve.v1 import worker_pb2 as pb

    def request(spec, ids, n):
        return pb.PrefillRequest(token_ids=ids, sample_index=n, sampling=gen_pb.SamplingParams(structured=spec))

    service = SimpleNamespace(engine=SimpleNamespace(grammars=grammars()))
    spec = gen_pb.StructuredOutput(regex="(ab)+x")
    constraint = await PrefillService._constraint(service, request(spec, [9, 9, 3, 1], 2))  # outputs "ab", "a"
    row = unconstrained(1, WIDTH)[0]
    constraint.fill(row)
    assert allowed_ids(row, WIDTH) == [2]
    assert await PrefillService._constraint(service, request(gen_pb.StructuredOutput(), [9], 0)) is None
    with pytest.raises(ValueError, match="do not fit the grammar"):
        await PrefillService._constraint(service, request(spec, [9, 9], 1))
    with pytest.raises(SpecError, match=r"^sampling\.structured\.regex: "):
        await PrefillService._constraint(service, request(gen_pb.StructuredOutput(regex="(a"), [9], 0))
    bare = SimpleNamespace(engine=SimpleNamespace(grammars=None))
    with pytest.raises(ValueError, match="^sampling.structured: this prefill worker has no tokenizer"):
        await PrefillService._constraint(bare, request(spec, [9], 0))
