"""Greedy tokens with n-gram speculative decoding on equal transformers' generate (and so speculation off):
through `pdserve up` (prefill worker + decode worker; every family: tests/e2e/test_parity.py), and on a decode worker
whose metrics show the speculation ran; the same with a draft model (draft_model): through `pdserve up` with a
smaller draft of another family, and on a decode worker whose counters move."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from tokenizers import Tokenizer

from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.server.client import build_request, stream
from tests.e2e.cluster import pdserve_up, wait_all_blocks_free
from tests.e2e.procs import (Procs, Stream, blocks, counter, generate, list_workers, request, spec_counters_agree,
                             wait_blocks_free, wait_until)
from tests.e2e.parity_cases import SPEC, hf_greedy

PROMPTS = [
    "def f(x):\n    return x * 2\n\ndef g(x):\n    return",
    "x = [1, 2, 3]\n" * 6,
    "import os\nimport sys\nimport os\n",
    "for i in range(10):\n    print(i)\n",
]
MAX_TOKENS = 12  # what parity_cases.hf_greedy generates


def _ids(addr: str, prompt: str) -> list[int]:
    return [t for m in stream(addr, build_request(prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0), timeout=120)
            for t in m.token_ids]


@pytest.mark.parametrize("family", ["llama", "mistral-windowed"])
def test_greedy_with_ngram_speculation_through_pdserve_up_equals_transformers(family, tiny_model, tmp_path):
    """With the stop rules and every block back; every family's greedy parity with speculation on is
    tests/e2e/test_parity.py's chunked and packed test, whose decode worker speculates."""
    model_dir = tiny_model(family)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    expected = [hf_greedy(model_dir, tok.encode(p).ids) for p in PROMPTS]
    with pdserve_up(model_dir, tmp_path, prefill_workers=1, decode_workers=1,
                    extra_args=["--speculative-config", SPEC]) as state:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda p: _ids(state["coordinator"], p), PROMPTS))
        for prompt, want, ids in zip(PROMPTS, expected, got):
            assert ids == want, f"{family}: prompt {prompt!r}"
        _stop_rules_hold(state["coordinator"], PROMPTS[1])
        pairs = wait_all_blocks_free(state["decode"])
        assert all(free == total for free, total in pairs), pairs


def draft_spec(draft_dir) -> str:
    return json.dumps({"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3})


def test_greedy_with_a_draft_model_through_pdserve_up_equals_transformers(tiny_model, tiny_draft, tmp_path):
    """The draft (a smaller Qwen2 of the same tokenizer) prefills its prompt KV on the decode worker beside the
    transfer of the target's from the prefill worker."""
    model_dir = tiny_model("llama")
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    expected = [hf_greedy(model_dir, tok.encode(p).ids) for p in PROMPTS]
    with pdserve_up(model_dir, tmp_path, prefill_workers=1, decode_workers=1,
                    extra_args=["--speculative-config", draft_spec(tiny_draft("qwen2"))]) as state:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda p: _ids(state["coordinator"], p), PROMPTS))
        for prompt, want, ids in zip(PROMPTS, expected, got):
            assert ids == want, f"draft_model: prompt {prompt!r}"
        _stop_rules_hold(state["coordinator"], PROMPTS[1])
        pairs = wait_all_blocks_free(state["decode"])
        assert all(free == total for free, total in pairs), pairs


def _stop_rules_hold(addr: str, prompt: str) -> None:
    """A stop string and a stop id end the stream where they would without speculation (the accepted tokens
    of one step arrive together; the coordinator cuts the text, the worker the ids)."""
    kw = dict(prompt=prompt, max_tokens=24, temperature=0.0, ignore_eos=True)
    msgs = list(stream(addr, build_request(**kw), timeout=120))
    full, ids = "".join(m.text for m in msgs), [t for m in msgs for t in m.token_ids]
    stop = full[5:8]
    assert len(full) > 8 and stop
    msgs = list(stream(addr, build_request(**kw, stop=[stop]), timeout=120))
    assert "".join(m.text for m in msgs) == full[: full.index(stop)]
    assert msgs[-1].finish_reason == gen_pb.FINISH_REASON_STOP
    stop_id = ids[6]
    msgs = list(stream(addr, build_request(**kw, stop_token_ids=[stop_id]), timeout=120))
    assert [t for m in msgs for t in m.token_ids] == ids[: ids.index(stop_id) + 1]
    assert msgs[-1].finish_reason == gen_pb.FINISH_REASON_STOP


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_a_speculating_decode_worker_counts_its_drafts_and_gives_transformers_tokens(method, tiny_model, tmp_path):
    """draft_model: the target as its own draft (the acceptance ceiling), so the accepted counter moves surely."""
    model_dir = tiny_model("llama")
    procs = Procs(model_dir, tmp_path)
    try:
        coordinator = procs.coordinator("coordinator")
        spec = SPEC if method == "ngram" else draft_spec(model_dir)
        d0 = procs.worker("d0", "decode", coordinator, "--kv-cache-tokens", "4096", "--speculative-config", spec)
        prompts = [[3, 14, 15, 92, 65, 35, 89], [7, 8, 9, 7, 8, 9, 7, 8]]
        for prompt in prompts:
            assert generate(coordinator.address, request(prompt, MAX_TOKENS)) == hf_greedy(model_dir, prompt)
        d, vllm = spec_counters_agree(d0, model_dir.name)
        accepted = counter(d, "pdserve_spec_decode_num_accepted_tokens_total")
        per_pos_vllm = {k: v for k, v in vllm.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos")}
        assert per_pos_vllm[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{model_name="{model_dir.name}",'
                            f'position="0",role="decode"}}'] > 0
        assert sum(per_pos_vllm.values()) == accepted
        assert wait_blocks_free([d0]) == [(4096 // 16, 4096 // 16)]
    finally:
        procs.stop_all()


def test_a_speculating_decode_worker_killed_mid_stream_migrates_with_exact_tokens(tiny_model, tmp_path):
    """Greedy and seeded sampled streams on speculating decode workers; one worker is killed mid-stream: the
    migrated streams continue on the other (prompt + tokens so far prefilled again; the token after them drawn
    by the prefill tier with the decode tier's draw, `server/seeded.py`) with exactly the tokens of an
    undisturbed run."""
    procs = Procs(tiny_model("llama"), tmp_path)
    try:
        a = procs.coordinator("coord")
        for name, role in (("p0", "prefill"), ("d0", "decode"), ("d1", "decode")):
            procs.worker(name, role, a, *(["--speculative-config", SPEC] if role == "decode" else []), wait=False)
        for name in ("p0", "d0", "d1"):
            procs.wait_serving(procs.procs[name])
        procs.wait_ready(a, 3)
        prompts = [[(7 * i + 5 * j) % 500 + 3 for j in range(12 + 3 * i)] for i in range(4)]
        reqs = [request(p, 200) for p in prompts]
        for i in (0, 2):  # seeded sampled beside greedy
            reqs[i].sampling.temperature, reqs[i].sampling.seed = 1.0, 1000 + i
        reference = [generate(a.address, r, timeout=120) for r in reqs]
        streams = [Stream(a.address, r) for r in reqs]
        wait_until(lambda: all(len(s.tokens) > 20 or not s.is_alive() for s in streams), "streams under way",
                   every=0.005)
        inflight = {w.address: w.inflight for w in list_workers(a) if w.role == "decode"}
        victim = max(("d0", "d1"), key=lambda n: inflight[procs.procs[n].address])
        at_kill = [len(s.tokens) for s in streams]
        procs.kill(victim)
        for s in streams:
            s.join(120)
        for i, (s, ref) in enumerate(zip(streams, reference)):
            assert s.error is None, s.error
            assert s.tokens == ref, (i, at_kill, next(j for j, (x, y) in enumerate(zip(s.tokens, ref)) if x != y))
        survivor = procs.procs["d1" if victim == "d0" else "d0"]
        assert wait_blocks_free([survivor]) == [blocks(survivor)] and blocks(survivor)[0] == blocks(survivor)[1]
        assert counter(survivor.metrics(), "pdserve_spec_decode_num_drafts_total") > 0
    finally:
        procs.stop_all()
