"""Prefix caching and preemption through real processes (coordinator, JAX prefill, torch decode).

A second request sharing a cached prefix gets transformers' tokens while only its missing blocks
cross the wire (the decode worker's transfer metric); a small cache preempts and resumes sequences with
transformers' tokens; an OpenAI request with n = 4 computes and sends its prompt once, plus each other
choice's partial last block; every block comes back (free + cached = total).
"""

from __future__ import annotations

import re

import grpc
import httpx
import pytest

from pdserve.server.launcher import free_port
from pdserve.server.model.tokenizer import Tokenizer
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import generation_pb2_grpc
from tests.e2e.procs import Procs, Stream, counter, generate, request, wait_blocks_free, wait_until
from tests.hf_oracle import hf_greedy_tokens

BLOCK = 16


hf_greedy = hf_greedy_tokens  # (model_dir, ids, n): n tokens, an end-of-sequence token not ending them


@pytest.fixture(scope="module")
def http_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory, http_port):
    procs = Procs(tiny_model("qwen2"), tmp_path_factory.mktemp("prefix"))
    try:
        # conditional disaggregation off: these tests follow the KV the prefill tier sends past the cached blocks
        # (test_conditional_disagg.py follows the decode worker prefilling a short suffix itself)
        coordinator = procs.coordinator("coordinator", "--http-port", str(http_port),
                                        "--conditional-disagg-max-uncached", "0")
        procs.worker("p0", "prefill", coordinator)
        # 12 blocks of 16 tokens: two 40-token prompts growing to 160 tokens (10 blocks) cannot both fit
        procs.worker("d0", "decode", coordinator, "--kv-cache-tokens", str(12 * BLOCK), "--threads", "1")
        yield procs
    finally:
        procs.stop_all()


def test_a_cached_prefix_is_not_sent_again_and_gives_transformers_tokens(cluster):
    coordinator, d0 = cluster.procs["coordinator"], cluster.procs["d0"]
    system = [(7 * i) % 500 + 3 for i in range(5 * BLOCK)]  # 5 full blocks
    first, second = system + [11, 12, 13], system + [21, 22, 23, 24]
    before = counter(d0.metrics(), "pdserve_kv_transfer_bytes_total")
    assert generate(coordinator.address, request(first, 6)) == hf_greedy(cluster.model_dir, first, 6)
    sent_first = counter(d0.metrics(), "pdserve_kv_transfer_bytes_total") - before
    assert generate(coordinator.address, request(second, 6)) == hf_greedy(cluster.model_dir, second, 6)
    d = d0.metrics()
    sent_second = counter(d, "pdserve_kv_transfer_bytes_total") - before - sent_first
    per_token = sent_first // len(first)  # fp32 K and V of every layer
    assert sent_first == per_token * len(first)
    assert sent_second == per_token * (len(second) - 5 * BLOCK)  # only the tokens after the cached blocks
    assert counter(d, "pdserve_prefix_cache_hits_total") == 5 * BLOCK
    # the prefill worker computed only the 4 tokens after the same 5 blocks: the rest from its prefix KV
    p0 = cluster.procs["p0"].metrics()
    assert counter(p0, "pdserve_prefill_prefix_cache_hit_tokens_total") == 5 * BLOCK
    # its steps ran only compiled programs, whatever the background had compiled by then
    assert p0["pdserve_prefill_compile_waits_total"] == 0
    assert 0 < p0["pdserve_prefill_programs_compiled"] <= p0["pdserve_prefill_programs_total"]
    free, total = wait_blocks_free([d0])[0]
    assert free == total  # cached blocks no sequence holds count as free


def test_sequences_preempted_on_a_small_cache_resume_with_transformers_tokens(cluster):
    coordinator, d0 = cluster.procs["coordinator"], cluster.procs["d0"]
    prompts = [[(13 * i + k) % 500 + 3 for i in range(40)] for k in range(3)]
    preempted = counter(d0.metrics(), "pdserve_num_preemptions_total")
    streams = [Stream(coordinator.address, request(p, 120)) for p in prompts]
    for s in streams:
        s.join(300)
    assert [s.error for s in streams] == [None] * 3
    assert counter(d0.metrics(), "pdserve_num_preemptions_total") > preempted
    for p, s in zip(prompts, streams):
        assert s.tokens == hf_greedy(cluster.model_dir, p, 120)
    free, total = wait_blocks_free([d0])[0]
    assert free == total


def _single_token_letters(tok: Tokenizer) -> str:
    """The lowercase letters no other vocabulary entry contains: each is one token wherever it appears, so a
    string of them is exactly as many tokens as letters."""
    vocab = tok.hf.get_vocab()
    return "".join(c for c in "abcdefghijklmnopqrstuvwxyz" if c in vocab and not any(c in v for v in vocab if v != c))


def test_constrained_sequences_preempted_on_a_small_cache_keep_their_grammar(cluster):
    coordinator, d0 = cluster.procs["coordinator"], cluster.procs["d0"]
    tok = Tokenizer.from_dir(cluster.model_dir)
    letters = _single_token_letters(tok)
    assert len(letters) >= 2, f"the tiny tokenizer has no two single-token letters ({letters!r}): pick other characters"
    # each answer is exactly 110 tokens (one per letter), so each sequence grows to 40 + 110 tokens = 10 blocks:
    # any two decoding at once overflow the 12 blocks, however the three requests are staggered
    pattern = f"[{letters[:2]}]{{110}}"
    prompts = [[(17 * i + k) % 500 + 3 for i in range(40)] for k in range(3)]
    # the prefill worker's background compiles done, and the grammar children of the coordinator and the decode
    # worker started by a first constrained request: the three below arrive together, not staggered by either
    p0 = cluster.procs["p0"]
    wait_until(lambda: counter(p0.metrics(), "pdserve_prefill_compiles_pending") == 0, "p0's compiles done", timeout=300)
    warm = Stream(coordinator.address, gen_pb.GenerateRequest(
        token_ids=gen_pb.TokenIds(ids=prompts[0][:8]), sampling=gen_pb.SamplingParams(
            max_tokens=4, temperature=0.0, structured=gen_pb.StructuredOutput(regex=pattern))))
    warm.join(300)
    assert warm.error is None
    preempted = counter(d0.metrics(), "pdserve_num_preemptions_total")
    streams = [Stream(coordinator.address, gen_pb.GenerateRequest(
        token_ids=gen_pb.TokenIds(ids=p), sampling=gen_pb.SamplingParams(
            max_tokens=120, temperature=1.0, seed=k, structured=gen_pb.StructuredOutput(regex=pattern))))
        for k, p in enumerate(prompts)]
    for s in streams:
        s.join(300)
    assert [s.error for s in streams] == [None] * 3
    assert counter(d0.metrics(), "pdserve_num_preemptions_total") > preempted
    for s in streams:
        assert s.finish_reason == gen_pb.FINISH_REASON_STOP and len(s.tokens) == 110
        assert re.fullmatch(pattern, tok.decode(s.tokens)), tok.decode(s.tokens)
    free, total = wait_blocks_free([d0])[0]
    assert free == total


def test_n_choices_share_the_prompts_kv_computed_and_sent_once(cluster, http_port):
    """Runs last: the tests above read absolute counters."""
    coordinator, p0, d0 = cluster.procs["coordinator"], cluster.procs["p0"], cluster.procs["d0"]
    base = f"http://127.0.0.1:{http_port}"
    model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
    tail, new = 5, 8
    length = 3 * BLOCK + tail  # 3 full blocks and a partial one; with 8 new tokens each choice stays in 4 blocks

    def prompt(k: int) -> list[int]:
        return [(11 * i + k) % 500 + 3 for i in range(length)]

    def counters() -> tuple[float, float]:
        """(prompt tokens p0 computed, KV bytes d0 received)."""
        return (counter(p0.metrics(), "pdserve_prefill_computed_tokens_total"),
                counter(d0.metrics(), "pdserve_kv_transfer_bytes_total"))

    def complete(ids: list[int], n: int, **fields) -> list[str]:
        body = {"model": model, "prompt": ids, "n": n, "max_tokens": new, "ignore_eos": True, **fields}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]

    one, shared, sampled = prompt(1), prompt(2), prompt(3)
    computed0, received0 = counters()
    complete(one, 1, temperature=0)
    computed1, received1 = counters()
    per_token = (received1 - received0) // length  # fp32 K and V of every layer
    assert (computed1 - computed0, received1 - received0) == (length, per_token * length)

    greedy = complete(shared, 4, temperature=0)
    computed4, received4 = counters()
    # the prompt computed and sent once; each other choice computes and receives only its partial block
    assert computed4 - computed1 == length + 3 * tail
    assert received4 - received1 == per_token * (length + 3 * tail)
    ids, text = generate_with_text(coordinator.address, request(shared, new))
    assert ids == hf_greedy(cluster.model_dir, shared, new)
    assert greedy == [text] * 4

    # seeded choices draw with seed + i, as one request per choice does
    choices = complete(sampled, 4, temperature=1.0, seed=1234)
    assert choices == [complete(sampled, 1, temperature=1.0, seed=1234 + i)[0] for i in range(4)]
    assert len(set(choices)) > 1
    free, total = wait_blocks_free([d0])[0]
    assert free == total


def generate_with_text(address: str, req) -> tuple[list[int], str]:
    """pdserve.v1.Generate's token ids and text."""
    with grpc.insecure_channel(address) as ch:
        replies = list(generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=60))
    return [t for m in replies for t in m.token_ids], "".join(m.text for m in replies)
