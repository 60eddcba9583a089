"""draft_model speculation in the native engine: a real draft proposes exactly its own greedy tokens and the
target accepts exactly their common prefix with its own; a draft equal to the target is always accepted
(greedy); greedy and seeded tokens equal speculation off on several families, through preemption; unseeded
sampling keeps the target's law (chi-square on a tiny vocabulary); the draft's blocks are the sequence's; the
measured step cost includes the draft's forwards; a draft that cannot draft is refused at start."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pdserve.kvcache.layout import KvLayout
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.server.decode.config import DecodeConfig
from pdserve.server.decode.engine import DecodeEngine
from pdserve.server.decode.kv_cache import PagedKvCache
from pdserve.server.decode.sequence import SeqState
from pdserve.server.decode.spec.config import SpeculativeConfig
from pdserve.server.decode.spec import speculator as speculator_module
from pdserve.server.decode.spec.rejection import accept_or_resample, accepted
from tests.decode.test_spec_engine import _admit, _all_back, _drain, _greedy, _manual, _model, _one_step, _reference
from tests.decode.loop_hold import held


def _engine(path, draft, num_blocks: int = 64, block_size: int = 4, k: int | None = 3, **kw) -> DecodeEngine:
    model = _model(path)
    c = model.config
    layout = KvLayout(c.num_layers, c.num_kv_heads, c.head_dim, block_size=block_size, dtype="float32")
    spec = None if k is None else SpeculativeConfig("draft_model", k, model=str(draft))
    return DecodeEngine(model, layout, num_blocks=num_blocks,
                        **{"max_running": 8, "speculative": spec, "draft_model": None if k is None else _model(draft),
                           **kw})


async def _drafted(engine: DecodeEngine) -> None:
    """Until no draft prompt prefill runs."""
    while engine.draft.prefilling:
        await asyncio.sleep(0.005)


def _noisy(src: Path, dst: Path, scale: float, seed: int = 0) -> Path:
    """A copy of the checkpoint with gaussian noise (scale x each tensor's std) on its weights: a draft that
    agrees with the target often, not always."""
    from safetensors.numpy import load_file, save_file

    if not dst.exists():
        shutil.copytree(src, dst)
        rng = np.random.default_rng(seed)
        for f in dst.glob("*.safetensors"):
            tensors = load_file(f)
            noisy = {k: (v + scale * v.std() * rng.standard_normal(v.shape)).astype(v.dtype) for k, v in tensors.items()}
            save_file(noisy, f, metadata={"format": "pt"})
    return dst


def _greedy_from(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens of `model` after ids, each from a fresh prefill of the whole context (no cache kept)."""
    c, out = model.config, []
    for _ in range(n):
        ctx = ids + out
        blocks = -(-len(ctx) // 4)
        cache = PagedKvCache(KvLayout(c.num_layers, c.num_kv_heads, c.head_dim, 4, "float32"), blocks)
        out.append(int(model.prefill(torch.tensor(ctx), list(range(blocks)), cache)[-1].argmax()))
    return out


async def test_a_real_draft_proposes_its_greedy_tokens_and_the_target_accepts_exactly_the_common_prefix(
        tiny_model, tmp_path):
    path = tiny_model("qwen3")
    draft = _noisy(path, tmp_path / "noisy-qwen3", 0.6)
    prompt = [3, 14, 15, 92, 65, 35, 89]
    r = await _reference(path, prompt, _greedy(16))
    engine = _engine(path, draft, k=3)
    _manual(engine)  # nothing measured: every step takes the full k the room allows
    seq = await _admit(engine, "a", prompt, _greedy(16))
    await _drafted(engine)
    assert seq.draft_len == len(prompt)  # the prompt's draft KV, computed beside the first token
    proposed = taken = 0
    while seq.state is SeqState.RUNNING:
        done = len(seq.output_ids)
        want = _greedy_from(_model(draft), seq.token_ids, max(0, min(3, 16 - done - 1)))
        assert _one_step(engine) == [want]
        m = accepted(want, r[done:])
        assert seq.output_ids == r[: done + m + 1]
        proposed, taken = proposed + len(want), taken + m
    assert seq.output_ids == r
    s = engine.speculator
    assert (s.num_draft_tokens, s.num_accepted) == (proposed, taken)
    assert 0 < taken < proposed  # both paths ran: accepted runs (the draft's KV kept) and rejections
    assert engine.sequences == {} and _all_back(engine)


async def test_a_draft_equal_to_the_target_has_every_greedy_proposal_accepted(tiny_model):
    path = tiny_model("llama")
    prompts = [[3, 14, 15, 92, 65], [7, 8, 9, 7, 8, 9, 7, 8], list(range(40, 60))]
    refs = [await _reference(path, p, _greedy(20)) for p in prompts]
    engine = _engine(path, path, k=4)
    seqs = [await _admit(engine, f"r{i}", p, _greedy(20)) for i, p in enumerate(prompts)]
    outs = await asyncio.gather(*(_drain(s) for s in seqs))
    assert [[s.output_ids[0], *o] for s, o in zip(seqs, outs)] == refs
    s = engine.speculator
    assert s.num_drafts > 0 and s.acceptance_rate == 1.0
    assert _all_back(engine)
    await engine.close()


@pytest.mark.parametrize("family, kind", [("llama", "small qwen2"), ("mistral-windowed", "noisy"),
                                          ("gemma2", "noisy"), ("qwen3_moe", "noisy")])
async def test_greedy_with_a_draft_model_equals_it_off(family, kind, tiny_model, tiny_draft, tmp_path):
    path = tiny_model(family)
    draft = tiny_draft("qwen2") if kind == "small qwen2" else _noisy(path, tmp_path / f"noisy-{family}", 0.2)
    prompts = [list(range(3, 10)) * 3, [7, 8, 9, 7, 8, 9, 7, 8], [40, 41, 42, 43] * 4 + [40], [100, 5, 100, 5]]
    results = []
    for k in (None, 3):
        engine = _engine(path, draft, k=k)
        seqs = [await _admit(engine, f"r{i}", p, _greedy(24)) for i, p in enumerate(prompts)]
        outs = await asyncio.gather(*(_drain(s) for s in seqs))
        results.append([[s.output_ids[0], *o] for s, o in zip(seqs, outs)])
        assert _all_back(engine)
        await engine.close()
    assert results[0] == results[1]
    assert engine.speculator.num_drafts > 0
    if kind == "noisy":
        assert engine.speculator.num_accepted > 0


@pytest.mark.parametrize("kind", ["self", "noisy"])
async def test_seeded_sampling_with_penalties_and_logprobs_equals_it_off_whatever_the_draft(kind, tiny_model, tmp_path):
    """The draft draws with the request's own (seed, token index) numbers; the target's draw decides. The target as
    its own draft lands on the target's draws (accepted); a perturbed one mostly not (rejected): the tokens are the
    same either way."""
    path = tiny_model("qwen2")
    draft = path if kind == "self" else _noisy(path, tmp_path / "noisy-qwen2", 0.3)
    prompt = [11, 12, 13, 14, 11, 12]
    sampling = gen_pb.SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, top_k=40, seed=99,
                                     repetition_penalty=1.1, presence_penalty=0.2, min_tokens=5, logprobs=2,
                                     ignore_eos=True)
    off = _engine(path, draft, k=None)
    ref = await _admit(off, "r", prompt, sampling)
    want = [ref.output_ids[0], *await _drain(ref)]
    await off.close()
    on = _engine(path, draft, k=3)
    seq = await _admit(on, "r", prompt, sampling)
    assert [seq.output_ids[0], *await _drain(seq)] == want
    assert [lp.token_id for lp in seq.logprobs] == [lp.token_id for lp in ref.logprobs]
    s = on.speculator
    assert s.num_drafts > 0 and (s.num_accepted > 0 if kind == "self" else s.num_accepted < s.num_draft_tokens)
    await on.close()


async def test_preempted_sequences_with_a_draft_resume_with_the_tokens_of_speculation_off(tiny_model):
    """The draft's KV sits at the sequence's block ids: preemption frees both, readmission recomputes both."""
    path = tiny_model("qwen2")
    prompts = [[5, 6, 7, 8, 9], [20, 21, 22], [30, 31, 32, 33, 34, 35]]
    results = []
    for k in (None, 3):
        engine = _engine(path, path, num_blocks=6, k=k, enable_prefix_caching=False)
        with held(engine):  # all three step from the first step: preempted whatever loads the machine
            seqs = [await _admit(engine, f"p{i}", p, _greedy(16)) for i, p in enumerate(prompts)]
        outs = await asyncio.gather(*(_drain(s) for s in seqs))
        assert engine.scheduler.num_preemptions >= 2
        results.append([[s.output_ids[0], *o] for s, o in zip(seqs, outs)])
        assert _all_back(engine)
        await engine.close()
    assert results[0] == results[1]
    assert engine.speculator.num_drafts > 0 and engine.speculator.acceptance_rate == 1.0


async def test_an_abort_while_the_drafts_prompt_prefill_runs_frees_the_blocks_once_it_ends(tiny_model, tiny_draft):
    path = tiny_model("llama")
    engine = _engine(path, tiny_draft("llama"), num_blocks=16)
    release = threading.Event()
    prefill = engine.draft.prefill_prompt
    engine.draft.prefill_prompt = lambda seq: (release.wait(30), prefill(seq))
    seq = engine.add(pb_request("a", list(range(3, 12)), _greedy(8)))
    await seq.admitted
    assert seq.block_table == [0, 1, 2] and engine.draft.prefilling == {"a"}
    assert engine.abort("a")
    assert engine.pool.num_free == 13 and "a" in engine._deferred  # the thread still writes those blocks
    release.set()
    await _drafted(engine)
    assert engine._deferred == {} and _all_back(engine)
    await engine.close()


async def test_a_migrated_seeded_stream_continues_with_the_undisturbed_tokens(tiny_model, tmp_path):
    """A migration sends the prompt and the outputs so far (num_output_tokens): the new worker's draft prefills
    them all as its prompt, and the seeded tokens after are the undisturbed stream's (they do not depend on the
    draft, nor on where it stood)."""
    path = tiny_model("mistral")
    draft = _noisy(path, tmp_path / "noisy-mistral", 0.3)
    prompt = [31, 32, 33, 31, 32]
    sampling = gen_pb.SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=5, ignore_eos=True)
    a = _engine(path, draft)
    seq = await _admit(a, "r", prompt, sampling)
    whole = [seq.output_ids[0], *await _drain(seq)]
    await a.close()
    b = _engine(path, draft)
    moved = b.add(pb_request("r", prompt + whole[:7], sampling, num_output_tokens=7))
    await moved.admitted
    await b.prefill_locally(moved)  # the target's KV (the prefill tier's, in a cluster)
    await _drafted(b)
    assert moved.draft_len == len(prompt) + 7
    b.start(moved, whole[7])  # the token the prefill tier draws at index 7 (server/seeded.py)
    assert [moved.output_ids[0], *await _drain(moved)] == whole[7:]
    assert b.speculator.num_drafts > 0 and _all_back(b)
    await b.close()


def pb_request(rid: str, prompt: list[int], sampling, **kw):
    from pdserve.v1 import worker_pb2 as pb

    return pb.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling, local_prefill=True, **kw)


async def test_the_measured_step_cost_includes_the_drafts_forward_steps(tiny_model, tiny_draft, monkeypatch):
    """A clock that advances one second per draft forward: every measured (batch, positions) cost is exactly
    the positions - 1 draft forwards the step ran (`spec/policy.py` then weighs the draft's cost)."""
    path = tiny_model("qwen2")
    engine = _engine(path, tiny_draft("qwen2"), k=3)
    clock = [0.0]
    monkeypatch.setattr(speculator_module, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    draft = engine.draft.model
    def ticking(forward):
        def run(*a, **kw):
            clock[0] += 1.0
            return forward(*a, **kw)
        return run

    for name in ("verify", "decode"):
        monkeypatch.setattr(draft, name, ticking(getattr(draft, name)))
    seq = await _admit(engine, "a", [3, 14, 15, 92, 65], _greedy(30))
    await _drain(seq)
    cost = engine.speculator.policy.cost
    assert any(positions > 1 for _, positions in cost)
    assert all(seconds == positions - 1 for (_, positions), seconds in cost.items()), cost
    await engine.close()


def _vocab8(out: Path, seed: int) -> Path:
    """A Llama of 8 tokens, random weights spread enough that the target's law and the draft's differ."""
    import transformers

    if not (out / "config.json").exists():
        config = transformers.LlamaConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                          max_position_embeddings=64, initializer_range=0.4, tie_word_embeddings=False,
                                          bos_token_id=0, eos_token_id=1)
        torch.manual_seed(seed)
        transformers.LlamaForCausalLM(config).save_pretrained(out)
    return out


def _next_law(model, ids: list[int]) -> torch.Tensor:
    c = model.config
    blocks = -(-len(ids) // 4)
    cache = PagedKvCache(KvLayout(c.num_layers, c.num_kv_heads, c.head_dim, 4, "float32"), blocks)
    return model.prefill(torch.tensor(ids), list(range(blocks)), cache)[-1].softmax(-1)  # [V]


async def test_unseeded_sampling_with_a_draft_keeps_the_targets_law(tmp_path):
    """The first two decoded tokens' joint law (64 cells) against the target's exact one, chi-square; the draft's
    own joint law differs enough that emitting it would fail by far (the test's power, computed)."""
    from scipy.stats import chisquare

    target, draft = _vocab8(tmp_path / "target", 0), _vocab8(tmp_path / "draft", 1)
    prompt, first = [2, 5, 3, 7], 4
    ctx = prompt + [first]
    laws = {}
    for name, path in (("p", target), ("q", draft)):
        m = _model(path)
        one = _next_law(m, ctx)
        laws[name] = torch.stack([one[a] * _next_law(m, ctx + [a]) for a in range(8)]).flatten().double()  # [64]
    sampling = gen_pb.SamplingParams(max_tokens=4, temperature=1.0, top_p=1.0, ignore_eos=True)
    engine = _engine(target, draft, num_blocks=64 * 3 + 8, k=2, max_running=64)
    _manual(engine)
    counts = np.zeros(64)
    rounds = 24
    for round_ in range(rounds):
        seqs = [await _admit(engine, f"s{round_}-{i}", prompt, sampling, first) for i in range(64)]
        await _drafted(engine)
        while any(s.state is SeqState.RUNNING for s in seqs):
            _one_step(engine)
        for s in seqs:
            counts[s.output_ids[1] * 8 + s.output_ids[2]] += 1
    n = counts.sum()
    p, q = laws["p"].numpy(), laws["q"].numpy()
    assert n * ((q - p) ** 2 / p).sum() > 200  # the draft's law would give a chi-square statistic near this
    big = p * n >= 5
    observed = np.append(counts[big], counts[~big].sum())
    expected = np.append(p[big], p[~big].sum())
    expected = expected / expected.sum() * n
    assert chisquare(observed, expected).pvalue > 0.001, (counts.tolist(), (p * n).round(1).tolist())
    s = engine.speculator
    assert 0 < s.num_accepted < s.num_draft_tokens
    assert _all_back(engine)


def test_the_general_rule_draws_the_targets_law_from_any_draft():
    """accept_or_resample alone: d ~ q, then the rule, 200k rows: the tokens' law is p (chi-square)."""
    from scipy.stats import chisquare

    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0])
    q = torch.tensor([0.05, 0.1, 0.25, 0.3, 0.3])
    n = 200_000
    torch.manual_seed(1)
    drafts = torch.multinomial(q, n, replacement=True, generator=gen)
    ok, tokens = accept_or_resample(p.expand(n, -1), q.expand(n, -1), drafts, torch.rand(n, generator=gen))
    counts = torch.bincount(tokens, minlength=5).double()
    assert counts[4] == 0  # p's zero is never emitted, though the draft proposes it 30% of the time
    expected = p[:4].double() / p[:4].double().sum() * counts.sum()
    assert chisquare(counts[:4].numpy(), expected.numpy()).pvalue > 0.001
    assert float(ok.double().mean()) == pytest.approx(float(torch.minimum(p, q).sum()), abs=0.005)  # 1 - TV(p, q)


def _config(target: Path, **spec) -> DecodeConfig:
    return DecodeConfig(model_dir=target, speculative_config=json.dumps({"method": "draft_model", **spec}))


def test_a_draft_that_cannot_draft_is_refused_at_start_naming_the_key(tiny_model, tiny_draft, tmp_path):
    target, draft = tiny_model("llama"), tiny_draft("qwen2")
    assert _config(target, model=str(draft), draft_tensor_parallel_size=1).speculative.model == str(draft)
    unset = _config(target, model=str(draft), draft_tensor_parallel_size=None)  # vLLM's default: the target's
    assert unset.speculative.draft_tensor_parallel_size == 1
    with pytest.raises(ValueError, match="model '/nowhere' is not a checkpoint the native decode engine serves"):
        _config(target, model="/nowhere")
    with pytest.raises(ValueError, match="draft_tensor_parallel_size 2: the native decode engine runs the draft"):
        _config(target, model=str(draft), draft_tensor_parallel_size=2)
    with pytest.raises(ValueError, match="method 'draft_model' needs model"):
        _config(target)
    with pytest.raises(ValueError, match="prompt_lookup_max: a key of method 'ngram'"):
        _config(target, model=str(draft), prompt_lookup_max=3)

    wide = tmp_path / "wide"
    shutil.copytree(draft, wide)
    config = json.loads((wide / "config.json").read_text())
    (wide / "config.json").write_text(json.dumps(dict(config, vocab_size=config["vocab_size"] + 64)))
    with pytest.raises(ValueError, match=r"the draft's vocab_size \d+ differs from the served model's \d+"):
        _config(target, model=str(wide))

    other = tmp_path / "other-tokenizer"
    shutil.copytree(draft, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="its tokenizer differs from the served model's .*: 2 vocabulary entries "
                                         "differ"):
        _config(target, model=str(other))

    short = tmp_path / "short"
    shutil.copytree(draft, short)
    (short / "config.json").write_text(json.dumps(dict(config, max_position_embeddings=128)))
    with pytest.raises(ValueError, match="the draft's positions end at 128, before the served max_model_len 512"):
        _config(target, model=str(short))
    DecodeConfig(model_dir=target, max_model_len=128,
                 speculative_config=json.dumps({"method": "draft_model", "model": str(short)}))


async def test_the_worker_builds_the_draft_and_sizes_its_blocks_for_both_caches(tiny_model, tiny_draft):
    from pdserve.server.decode.device import bytes_per_block
    from pdserve.server.decode.spec.draft import draft_layout
    from pdserve.server.decode.startup import build_native_engine

    target, draft = tiny_model("llama"), tiny_draft("llama")
    config = DecodeConfig(model_dir=target, kv_cache_memory="1MiB", max_running=64, device="cpu",
                          speculative_config=json.dumps({"method": "draft_model", "model": str(draft),
                                                         "num_speculative_tokens": 2}))
    _, engine, layout = build_native_engine(config)
    per_block = bytes_per_block(layout) + PagedKvCache.bytes_per_block(draft_layout(engine.draft.model, 16))
    assert engine.num_total_blocks == 2**20 // per_block
    assert engine.draft.cache.num_blocks == engine.cache.num_blocks == engine.num_total_blocks + 1  # the pad block
    assert engine.draft.model.config.num_layers == 1 and engine.model.config.num_layers == 2
    seq = await _admit(engine, "a", [3, 14, 15, 92, 65, 35, 89], _greedy(12))
    ref = await _reference(target, [3, 14, 15, 92, 65, 35, 89], _greedy(12))
    assert [seq.output_ids[0], *await _drain(seq)] == ref
    await engine.close()


async def test_a_constrained_sequence_beside_a_drafted_one_keeps_its_grammar_and_is_never_drafted(tiny_model):
    import re

    from pdserve.server.model.tokenizer import Tokenizer
    from tests.decode.test_structured import REGEX, _grammars, _sampled

    path = tiny_model("qwen2")
    tok = Tokenizer.from_dir(path)
    prompt = [5, 6, 7, 8] * 6
    reference = await _reference(path, prompt, _greedy(24))
    engine = _engine(path, path, k=3, grammars=_grammars(path))
    engine._step_each = None  # a failed batched step would call it: the test fails there instead
    prefilled, prefill = [], engine.draft.prefill_prompt
    engine.draft.prefill_prompt = lambda seq: (prefilled.append(seq.request_id), prefill(seq))
    free = await _admit(engine, "free", prompt, _greedy(24))
    constrained = await _admit(engine, "re", [9, 10], _sampled(32, 1, regex=REGEX))
    outs = await asyncio.gather(_drain(free), _drain(constrained))
    assert [free.output_ids[0], *outs[0]] == reference
    assert engine.speculator.num_drafts > 0 and engine.speculator.acceptance_rate == 1.0
    assert prefilled == ["free"]  # no draft prefill, no proposal for the constrained one: a token a step, masked
    assert re.fullmatch(REGEX, tok.decode(constrained.output_ids))
    assert constrained.finish_reason == gen_pb.FINISH_REASON_STOP
    assert _all_back(engine)
    await engine.close()
