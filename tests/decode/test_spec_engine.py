"""Speculative decoding in the native engine: scripted proposals give exact accepted counts and block ids;
greedy and seeded sampling give the tokens of speculation off; unseeded sampling keeps the distribution."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pdserve.kvcache.layout import KvLayout
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb
from pdserve.server.decode.engine import DecodeEngine
from pdserve.server.decode.sequence import Sequence, SeqState
from pdserve.server.decode.spec.config import SpeculativeConfig
from pdserve.server.decode.weights import build_model
from pdserve.server.model.config import load_config
from pdserve.server.model.weights import load_weights
from tests.decode.loop_hold import held

_MODELS: dict = {}


def _model(path):
    if path not in _MODELS:
        _MODELS[path] = build_model(load_config(path), load_weights(path))
    return _MODELS[path]


def _engine(path, num_blocks: int = 32, block_size: int = 4, k: int | None = None, **kw) -> DecodeEngine:
    model = _model(path)
    c = model.config
    layout = KvLayout(c.num_layers, c.num_kv_heads, c.head_dim, block_size=block_size, dtype="float32")
    spec = None if k is None else SpeculativeConfig("ngram", k, 1, 3)
    return DecodeEngine(model, layout, num_blocks=num_blocks, **{"max_running": 8, "speculative": spec, **kw})


def _greedy(max_tokens: int, **kw) -> gen_pb.SamplingParams:
    return gen_pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, top_p=1.0, top_k=0, ignore_eos=True, **kw)


def _request(rid: str, prompt: list[int], sampling: gen_pb.SamplingParams) -> pb.DecodeRequest:
    return pb.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling, local_prefill=True)


async def _admit(engine: DecodeEngine, rid: str, prompt: list[int], sampling: gen_pb.SamplingParams,
                 first: int | None = None) -> Sequence:
    seq = engine.add(_request(rid, prompt, sampling))
    await seq.admitted
    token = await engine.prefill_locally(seq)
    engine.start(seq, token if first is None else first)
    return seq


async def _drain(seq: Sequence) -> list[int]:
    got = []
    while (ids := await seq.events.get()) is not None:
        got.extend(ids)
    return got


def _all_back(engine: DecodeEngine) -> bool:
    return engine.pool.num_free + engine.scheduler.cache.num_evictable == engine.pool.num_total


def _manual(engine: DecodeEngine) -> None:
    """The loop never starts: the test runs each step itself (`_one_step`)."""
    engine._wake = lambda: None


def _one_step(engine: DecodeEngine) -> list[list[int]] | None:
    """What one pass of the engine's loop does (without measuring it): schedule, propose, step, postprocess; the
    step's proposed tokens (a draft model's drawn in the step)."""
    batch = engine.scheduler.schedule()
    proposals = engine.speculator.propose(batch) if engine.speculator else None
    tokens, lps = engine._step(batch, engine.speculator.verifier(proposals) if proposals is not None else None)
    engine._postprocess(batch, tokens, lps)
    return None if proposals is None else proposals.tokens


def _script(engine: DecodeEngine, proposals: list[list[int]]) -> list[int | None]:
    """The proposer returns these, in order, one per call (cut to the k it is asked for); records each k."""
    asked: list[int | None] = []
    queue = list(proposals)

    def propose(token_ids: list[int], k: int | None = None) -> list[int]:
        asked.append(k)
        return queue.pop(0)[:k]

    engine.speculator.proposer.propose = propose
    return asked


async def _reference(path, prompt: list[int], sampling: gen_pb.SamplingParams, first: int | None = None) -> list[int]:
    engine = _engine(path)
    seq = await _admit(engine, "ref", prompt, sampling, first)
    out = [seq.output_ids[0], *await _drain(seq)]
    await engine.close()
    return out


async def test_scripted_proposals_accept_exactly_and_give_back_the_rejected_blocks(tiny_model):
    path = tiny_model("qwen3")  # its greedy tokens for this prompt differ from one another
    prompt = [3, 14, 15, 92, 65, 35, 89]  # 7 tokens: 2 blocks of 4
    r = await _reference(path, prompt, _greedy(12))
    wrong = (r[3] + 1) % 512
    engine = _engine(path, num_blocks=16, k=5)
    _manual(engine)
    asked = _script(engine, [[r[1], r[2], wrong, r[4], r[5]], [], [r[5], r[6], r[7]], [r[9], r[10], r[11]]])
    seq = await _admit(engine, "a", prompt, _greedy(12))
    assert seq.output_ids == [r[0]] and seq.block_table == [0, 1]

    _one_step(engine)  # 8 tokens + 5 proposed: 13 slots, 4 blocks; 2 accepted, then the model's own token
    assert seq.output_ids == r[:4] and seq.block_table == [0, 1, 2]  # block 3 held only rejected slots
    assert engine.pool.num_free == 13
    _one_step(engine)  # no proposal: a plain step
    assert seq.output_ids == r[:5] and seq.block_table == [0, 1, 2]
    _one_step(engine)  # 12 tokens + 3 proposed, all accepted, and the bonus token: 16 tokens, 4 blocks
    assert seq.output_ids == r[:9] and seq.block_table == [0, 1, 2, 4]  # the pool hands out block 3 last (FIFO)
    _one_step(engine)  # 3 outputs left: at most 2 proposals (a step emits up to k + 1)
    assert seq.output_ids == r and seq.state is SeqState.FINISHED
    assert seq.finish_reason == gen_pb.FINISH_REASON_LENGTH
    assert asked == [5, 5, 5, 2]
    s = engine.speculator
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted) == (3, 10, 7)
    assert s.accepted_per_pos == [3, 3, 1, 0, 0]
    assert engine.sequences == {} and _all_back(engine)


async def test_a_proposal_past_the_free_blocks_is_cut_and_never_preempts(tiny_model):
    path = tiny_model("qwen3")
    engine = _engine(path, num_blocks=4, k=5, enable_prefix_caching=False)
    _manual(engine)
    prompt = [3, 14, 15, 92, 65, 35, 89]
    r = await _reference(path, prompt, _greedy(8))
    _script(engine, [[r[1], r[2], r[3], r[4], r[5]], []])
    seq = await _admit(engine, "a", prompt, _greedy(8))  # blocks 0 and 1
    other = await _admit(engine, "b", [5, 6, 7], _greedy(8))  # block 2; block 3 is the only free one
    proposals = _one_step(engine)  # a: 8 tokens, 4 more slots fit in block 3, the fifth proposal does not
    assert proposals == [[r[1], r[2], r[3], r[4]], []]
    assert seq.output_ids == r[:6] and seq.block_table == [0, 1, 3] and other.block_table == [2]
    assert engine.scheduler.num_preemptions == 0


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "mistral-windowed", "gemma2", "gemma3",
                                    "mixtral", "qwen3_moe"])
async def test_greedy_with_ngram_speculation_equals_it_off(family, tiny_model):
    path = tiny_model(family)
    prompts = [list(range(3, 10)) * 3, [7, 8, 9, 7, 8, 9, 7, 8], [40, 41, 42, 43] * 4 + [40], [100, 5, 100, 5]]
    off, on = _engine(path, num_blocks=64), _engine(path, num_blocks=64, k=3)
    results = []
    for engine in (off, on):
        seqs = [await _admit(engine, f"r{i}", p, _greedy(24)) for i, p in enumerate(prompts)]
        outs = await asyncio.gather(*(_drain(s) for s in seqs))
        results.append([[s.output_ids[0], *o] for s, o in zip(seqs, outs)])
        assert _all_back(engine)
        await engine.close()
    assert results[0] == results[1]
    assert on.speculator.num_drafts > 0 and on.speculator.num_accepted > 0  # speculation ran, and paid sometimes


def _oracle(engine: DecodeEngine, prompt: list[int], reference: list[int], wrong_every: int = 3) -> None:
    """Proposes the reference's next tokens, one of every `wrong_every` proposals corrupted at its end."""
    calls = [0]

    def propose(token_ids: list[int], k: int | None = None) -> list[int]:
        calls[0] += 1
        done = len(token_ids) - len(prompt)
        p = reference[done : done + (k or 0)]
        if p and calls[0] % wrong_every == 0:
            p = p[:-1] + [(p[-1] + 1) % 512]
        return p

    engine.speculator.proposer.propose = propose


async def test_seeded_sampling_penalties_min_tokens_stop_ids_and_logprobs_hold_on_accepted_tokens(tiny_model):
    path = tiny_model("qwen2")
    prompt = [11, 12, 13, 14, 11, 12]
    probe = await _reference(path, prompt, _greedy(20))
    sampling = gen_pb.SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, top_k=40, seed=1234,
                                     repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.1,
                                     min_tokens=4, stop_token_ids=[probe[6]], logprobs=3, ignore_eos=True)
    off = _engine(path)
    ref = await _admit(off, "r", prompt, sampling)
    want = [ref.output_ids[0], *await _drain(ref)]
    want_lps = list(ref.logprobs)
    await off.close()

    on = _engine(path, k=3)
    _oracle(on, prompt, want)
    seq = await _admit(on, "r", prompt, sampling)
    got = [seq.output_ids[0], *await _drain(seq)]
    assert got == want and seq.finish_reason == ref.finish_reason
    assert on.speculator.num_accepted > 0
    assert len(seq.logprobs) == len(want_lps) == len(want)  # the local prefill's first one included
    for a, b in zip(seq.logprobs, want_lps):
        assert a.token_id == b.token_id and list(a.top_token_ids) == list(b.top_token_ids)
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert list(a.top_logprobs) == pytest.approx(list(b.top_logprobs), abs=1e-4)
    await on.close()


async def test_a_stop_id_inside_an_accepted_run_ends_it_there(tiny_model):
    path = tiny_model("qwen3")
    prompt = [3, 14, 15, 92, 65, 35, 89]
    r = await _reference(path, prompt, _greedy(12))
    stop = r[3]
    assert stop not in r[:3]
    engine = _engine(path, k=5)
    _manual(engine)
    _script(engine, [r[1:6]])
    seq = await _admit(engine, "a", prompt, _greedy(12, stop_token_ids=[stop]))
    _one_step(engine)  # all 5 accepted by the model, but the third accepted token stops it
    assert seq.output_ids == r[:4] and seq.finish_reason == gen_pb.FINISH_REASON_STOP
    assert engine.sequences == {} and _all_back(engine)


async def test_unseeded_sampling_with_speculation_keeps_the_distribution(tiny_model):
    """A chi-square test of the token after a fixed context, sampled with a proposal of the most likely token
    (accepted with its probability, else a draw from the rest) against sampling without speculation."""
    from scipy.stats import chi2_contingency

    path = tiny_model("mistral")
    prompt, first = [21, 22, 23, 24], 25
    sampling = gen_pb.SamplingParams(max_tokens=2, temperature=1.0, top_p=1.0, top_k=6, ignore_eos=True)
    logits = _model(path).prefill(torch.tensor(prompt + [first]), list(range(2)), _engine(path).cache)[-1]
    likely = int(logits.argmax())
    n = 480
    counts: list[dict[int, int]] = []
    for k in (None, 1):
        engine = _engine(path, num_blocks=2 * 64 + 1, k=k, max_running=64)
        _manual(engine)
        if k:
            engine.speculator.proposer.propose = lambda ids, k=None: [likely]
        seen: dict[int, int] = {}
        for round_ in range(n // 64):
            seqs = [await _admit(engine, f"s{round_}-{i}", prompt, sampling, first) for i in range(64)]
            _one_step(engine)
            for s in seqs:
                assert s.state is SeqState.FINISHED and len(s.output_ids) == 2
                seen[s.output_ids[1]] = seen.get(s.output_ids[1], 0) + 1
        counts.append(seen)
        if k:
            drafts, acc = engine.speculator.num_draft_tokens, engine.speculator.num_accepted
            assert drafts == n - n % 64 and acc == seen.get(likely, 0)
    tokens = sorted(set(counts[0]) | set(counts[1]))
    assert len(tokens) <= 6
    table = [[c.get(t, 0) for t in tokens] for c in counts]
    assert chi2_contingency(table).pvalue > 0.001, table


async def test_preempted_speculating_sequences_resume_without_losing_or_repeating_a_token(tiny_model):
    """As test_engine's preemption test, with speculation on: lookahead blocks come only from free ones, so
    they never preempt; the blocks the sequences need do, and each resumes with speculation's tokens = off's."""
    path = tiny_model("qwen2")
    prompts = [[5, 6, 7, 8, 9], [20, 21, 22], [30, 31, 32, 33, 34, 35]]
    results = []
    for k in (None, 3):
        engine = _engine(path, num_blocks=6, k=k, enable_prefix_caching=False)
        with held(engine):  # all three step from the first step: preempted whatever loads the machine
            seqs = [await _admit(engine, f"p{i}", p, _greedy(16)) for i, p in enumerate(prompts)]
        outs = await asyncio.gather(*(_drain(s) for s in seqs))
        assert engine.scheduler.num_preemptions >= 2
        results.append([[s.output_ids[0], *o] for s, o in zip(seqs, outs)])
        assert all(s.output_ids == r for s, r in zip(seqs, results[-1]))
        assert _all_back(engine)
        await engine.close()
    assert results[0] == results[1]
    assert engine.speculator.num_drafts > 0


@pytest.mark.parametrize("shaped", [False, True], ids=["drawn-at-once", "drawn-in-order"])
async def test_seeded_sampling_with_speculation_equals_it_off_on_either_acceptance_path(tiny_model, shaped):
    """Without penalties or pending min_tokens every position is drawn in one sampler call; with them, position by
    position: both give the tokens and logprobs of speculation off."""
    path = tiny_model("mistral")
    prompt = [31, 32, 33, 31, 32]
    extra = {"presence_penalty": 0.4, "min_tokens": 6} if shaped else {}
    sampling = gen_pb.SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=7, logprobs=2, ignore_eos=True,
                                     **extra)
    off = _engine(path)
    ref = await _admit(off, "r", prompt, sampling)
    want = [ref.output_ids[0], *await _drain(ref)]
    await off.close()
    on = _engine(path, k=4)
    _oracle(on, prompt, want, wrong_every=2)
    seq = await _admit(on, "r", prompt, sampling)
    assert [seq.output_ids[0], *await _drain(seq)] == want
    assert [lp.token_id for lp in seq.logprobs] == [lp.token_id for lp in ref.logprobs]
    assert on.speculator.num_accepted > 0
    await on.close()


async def test_disable_by_batch_size_turns_speculation_off_for_big_batches(tiny_model):
    path = tiny_model("qwen3")
    model = _model(path)
    c = model.config
    layout = KvLayout(c.num_layers, c.num_kv_heads, c.head_dim, block_size=4, dtype="float32")
    engine = DecodeEngine(model, layout, num_blocks=32, max_running=8,
                          speculative=SpeculativeConfig("ngram", 3, 1, 3, disable_by_batch_size=2))
    _manual(engine)
    asked = _script(engine, [[5, 6]])
    a = await _admit(engine, "a", [7, 8, 9], _greedy(8))
    assert _one_step(engine) == [[5, 6]]  # one sequence: it speculates
    b = await _admit(engine, "b", [7, 8, 9], _greedy(8))
    assert _one_step(engine) == [[], []] and asked == [3]  # two: off, nothing even looked up
    assert a.state is b.state is SeqState.RUNNING


async def test_ragged_proposals_in_one_batch_cross_block_boundaries_and_change_no_token(tiny_model):
    """Five sequences verify proposals of different lengths (0 to 5, some wrong) in the same steps, so rows are
    padded (their pad entries writing the pad block) and lookahead slots cross block boundaries: every sequence's
    tokens are those of speculation off."""
    import random

    path = tiny_model("mistral")
    prompts = [[(11 * i + 7 * j) % 500 + 3 for j in range(3 + 5 * i)] for i in range(5)]
    off = _engine(path, num_blocks=64)
    refs = {}
    for i, p in enumerate(prompts):
        seq = await _admit(off, f"r{i}", p, _greedy(20))
        refs[tuple(p)] = [seq.output_ids[0], *await _drain(seq)]
    await off.close()
    on = _engine(path, num_blocks=64, k=5)
    _manual(on)
    rng = random.Random(3)
    lengths = []

    def propose(token_ids: list[int], k: int | None = None) -> list[int]:
        prompt = next(p for p in prompts if token_ids[: len(p)] == p and len(token_ids) > len(p))
        done = len(token_ids) - len(prompt)
        p = refs[tuple(prompt)][done : done + rng.randrange(0, (k or 0) + 1)]
        if p and rng.random() < 0.4:
            p[rng.randrange(len(p))] += 1
        lengths.append(len(p))
        return p

    on.speculator.proposer.propose = propose
    seqs = [await _admit(on, f"r{i}", p, _greedy(20)) for i, p in enumerate(prompts)]
    while any(s.state is SeqState.RUNNING for s in seqs):
        _one_step(on)
    assert [s.output_ids for s in seqs] == [refs[tuple(p)] for p in prompts]
    assert len(set(lengths)) >= 4 and on.speculator.num_accepted > 0
    assert on.sequences == {} and _all_back(on)


async def test_constrained_sequences_beside_speculating_ones_keep_their_grammar_and_get_no_proposal(tiny_model):
    """A constrained sequence samples one token per step under its mask inside the verify step of the others."""
    import json
    import re

    from pdserve.server.model.tokenizer import Tokenizer
    from tests.decode.test_structured import REGEX, _grammars, _sampled

    path = tiny_model("qwen2")
    tok = Tokenizer.from_dir(path)
    prompt = [5, 6, 7, 8] * 6  # the free sequence's n-gram proposals come from its repeating prompt
    reference = await _reference(path, prompt, _greedy(24))
    engine = _engine(path, num_blocks=64, k=4, grammars=_grammars(path))
    engine._step_each = None  # a failed batched step would call it: the test fails there instead
    asked = []
    propose = engine.speculator.proposer.propose
    engine.speculator.proposer.propose = lambda ids, k=None: asked.append(list(ids)) or propose(ids, k)
    free = await _admit(engine, "free", prompt, _greedy(24))
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    constrained = [await _admit(engine, "re", [9, 10], _sampled(32, 1, regex=REGEX)),
                   await _admit(engine, "js", [12, 3], _sampled(48, 2, json_schema=json.dumps(schema)))]
    outs = await asyncio.gather(*(_drain(s) for s in [free, *constrained]))
    assert [free.output_ids[0], *outs[0]] == reference
    assert engine.speculator.num_drafts > 0
    assert all(ids[:len(prompt)] == prompt for ids in asked)  # only the free sequence was looked up
    assert re.fullmatch(REGEX, tok.decode(constrained[0].output_ids))
    assert set(json.loads(tok.decode(constrained[1].output_ids))) == {"n"}
    assert [s.finish_reason for s in constrained] == [gen_pb.FINISH_REASON_STOP] * 2
    assert _all_back(engine)
    await engine.close()
