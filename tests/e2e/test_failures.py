"""Workers die under load (`kill -9`) and no request is lost: real processes on 127.0.0.1.

Coordinator A has its workers by registration (migration limit 2); coordinator B routes over the same
workers by flag, with --max-migrations 0, so one kill shows both sides of the limit.
"""

from __future__ import annotations

import re

import grpc
import pytest

from pdserve.server.model.tokenizer import Tokenizer
from pdserve.v1 import generation_pb2 as gen_pb

from tests.e2e.procs import Procs, Stream, blocks, counter, generate, list_workers, request, wait_blocks_free, wait_until

PROMPTS = [[(7 * i + 5 * j) % 500 + 3 for j in range(12 + 3 * i)] for i in range(6)]
LONG = 400  # tokens per stream: long enough to kill a worker in the middle


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    procs = Procs(tiny_model("llama"), tmp_path_factory.mktemp("failures"))
    try:
        a = procs.coordinator("coord-a")
        for name, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"), ("d1", "decode")):
            procs.worker(name, role, a, wait=False)
        for name in ("p0", "p1", "d0", "d1"):
            procs.wait_serving(procs.procs[name])
        procs.wait_ready(a, 4)
        p = procs.procs
        procs.coordinator("coord-b", "--max-migrations", "0", "--prefill", p["p0"].address, "--prefill",
                          p["p1"].address, "--decode", p["d0"].address, "--decode", p["d1"].address)
        wait_until(lambda: [w.state for w in list_workers(procs.procs["coord-b"])] == ["ready"] * 4,
                   "4 workers ready in coord-b")
        yield procs
    finally:
        procs.stop_all()


@pytest.fixture(scope="module")
def reference(cluster):
    """Each prompt's greedy tokens with no failure."""
    streams = [Stream(cluster.procs["coord-a"].address, request(p, LONG)) for p in PROMPTS]
    for s in streams:
        s.join(120)
        assert s.error is None, s.error
    return [s.tokens for s in streams]


def test_kill_decode_mid_stream_migrates_with_exact_tokens_or_fails_past_the_limit(cluster, reference):
    p = cluster.procs
    a, b = p["coord-a"], p["coord-b"]
    streams_a = [Stream(a.address, request(prompt, LONG)) for prompt in PROMPTS]
    streams_b = [Stream(b.address, request(prompt, LONG)) for prompt in PROMPTS]
    everyone = streams_a + streams_b

    def both_on_one_worker() -> bool:
        if not all(s.tokens or not s.is_alive() for s in everyone):
            return False  # kill mid-stream: after every stream's first token
        ia = {w.address: w.inflight for w in list_workers(a) if w.role == "decode"}
        ib = {w.address: w.inflight for w in list_workers(b) if w.role == "decode"}
        return any(ia[p[n].address] and ib[p[n].address] for n in ("d0", "d1"))

    wait_until(both_on_one_worker, "streams of both coordinators on one decode worker", every=0.005)
    inflight_a = {w.address: w.inflight for w in list_workers(a) if w.role == "decode"}
    inflight_b = {w.address: w.inflight for w in list_workers(b) if w.role == "decode"}
    victim = max(("d0", "d1"), key=lambda n: min(inflight_a[p[n].address], inflight_b[p[n].address]))
    on_victim_a, on_victim_b = inflight_a[p[victim].address], inflight_b[p[victim].address]
    cluster.kill(victim)
    for s in streams_a + streams_b:
        s.join(120)

    for s, ref in zip(streams_a, reference):
        assert s.error is None, s.error
        assert s.tokens == ref  # nothing lost, nothing repeated, nothing different
    failed_b = [s for s in streams_b if s.error is not None]
    for s, ref in zip(streams_b, reference):
        if s.error is None:
            assert s.tokens == ref
        else:
            assert s.error.code() == grpc.StatusCode.UNAVAILABLE
            assert f"decode worker {p[victim].address}" in s.error.details()
            assert "migrated 0 times (--max-migrations)" in s.error.details()
            assert s.tokens == ref[: len(s.tokens)]
    migrated = counter(a.metrics(), "pdserve_migrations_total")
    print(f"\nkill -9 decode: sent {len(everyone)}; via A: completed {sum(s.error is None for s in streams_a)}, "
          f"migrated {migrated:.0f}; via B (--max-migrations 0): completed "
          f"{sum(s.error is None for s in streams_b)}, failed with a clear error {len(failed_b)}; lost 0")
    # (a stream may finish between the count and the kill)
    assert 1 <= len(failed_b) <= on_victim_b, (len(failed_b), inflight_b)
    assert 1 <= counter(a.metrics(), "pdserve_migrations_total") <= on_victim_a
    assert counter(b.metrics(), "pdserve_request_failure_total") == len(failed_b)

    survivor = p["d1" if victim == "d0" else "d0"]
    cluster.procs["survivor"] = survivor
    assert generate(a.address, request(PROMPTS[0], 20)) == reference[0][:20]
    assert generate(b.address, request(PROMPTS[1], 20)) == reference[1][:20]
    assert wait_blocks_free([survivor]) == [blocks(survivor)] and blocks(survivor)[0] == blocks(survivor)[1]
    wait_until(lambda: {w.address: w.state for w in list_workers(a)}[p[victim].address] == "dead", "victim dead")


def test_kill_decode_mid_answer_keeps_each_migrated_answer_in_its_grammar(cluster):
    """After the kill above: a fresh decode worker d2 beside the survivor; d2 dies mid-answer and its
    constrained streams (temperature 1) are re-prefilled with prompt + outputs, the grammar replayed."""
    p = cluster.procs
    a = p["coord-a"]
    d2 = cluster.worker("d2", "decode", a)
    tok = Tokenizer.from_dir(cluster.model_dir)
    pattern = "[a-z]{300}"
    streams = [Stream(a.address, gen_pb.GenerateRequest(
        token_ids=gen_pb.TokenIds(ids=prompt), sampling=gen_pb.SamplingParams(
            max_tokens=LONG, temperature=1.0, seed=i, structured=gen_pb.StructuredOutput(regex=pattern))))
        for i, prompt in enumerate(PROMPTS)]
    migrated = counter(a.metrics(), "pdserve_migrations_total")

    def mid_answer_on_d2() -> bool:
        started = all(s.tokens or not s.is_alive() for s in streams)
        return started and any(w.inflight for w in list_workers(a) if w.address == d2.address)

    wait_until(mid_answer_on_d2, "constrained streams mid-answer on d2", every=0.005)
    cluster.kill("d2")
    for s in streams:
        s.join(120)
    assert [s.error for s in streams] == [None] * len(PROMPTS)
    assert counter(a.metrics(), "pdserve_migrations_total") > migrated
    for s in streams:
        assert s.finish_reason == gen_pb.FINISH_REASON_STOP
        assert re.fullmatch(pattern, tok.decode(s.tokens)), tok.decode(s.tokens)
    assert wait_blocks_free([p["survivor"]]) == [blocks(p["survivor"])]
    wait_until(lambda: {w.address: w.state for w in list_workers(a)}[d2.address] == "dead", "d2 dead")


def test_kill_prefill_during_transfer_completes_elsewhere_and_leaks_no_block(cluster):
    p = cluster.procs
    a = p["coord-a"]
    prompts = [[(11 * i + 3 * j) % 500 + 3 for j in range(380 + i)] for i in range(8)]
    streams = [Stream(a.address, request(prompt, 6)) for prompt in prompts]
    wait_until(lambda: any(w.inflight for w in list_workers(a) if w.address == p["p0"].address), "p0 busy",
               every=0.005)
    cluster.kill("p0")
    for s in streams:
        s.join(120)
    assert [s.error for s in streams] == [None] * 8
    # the same prompts again, through the surviving prefill worker: the same greedy tokens
    assert [s.tokens for s in streams] == [generate(a.address, request(prompt, 6)) for prompt in prompts]
    assert counter(a.metrics(), "pdserve_prefill_retries_total") >= 1
    print(f"\nkill -9 prefill: sent {len(streams)}, completed {sum(s.error is None for s in streams)}, prefill "
          f"retries {counter(a.metrics(), 'pdserve_prefill_retries_total'):.0f}, leaked blocks 0; lost 0")
    free, total = wait_blocks_free([p["survivor"]])[0]
    assert free == total


def test_no_prefill_worker_alive_decode_prefills_locally(cluster, reference):
    p = cluster.procs
    a, b = p["coord-a"], p["coord-b"]
    cluster.kill("p1")
    wait_until(lambda: all(w.state == "dead" for w in list_workers(a) if w.role == "prefill"), "prefill tier dead")
    before = counter(a.metrics(), "pdserve_local_prefill_fallbacks_total")
    assert generate(a.address, request(PROMPTS[2], 30)) == reference[2][:30]
    assert generate(a.address, request(PROMPTS[3], 30)) == reference[3][:30]
    assert counter(a.metrics(), "pdserve_local_prefill_fallbacks_total") == before + 2
    assert counter(p["survivor"].metrics(), "pdserve_local_prefill_fallbacks_total") >= 2
    wait_until(lambda: all(w.state == "dead" for w in list_workers(b) if w.role == "prefill"), "B's prefill dead")
    assert generate(b.address, request(PROMPTS[0], 30)) == reference[0][:30]
    free, total = wait_blocks_free([p["survivor"]])[0]
    assert free == total


def test_worker_with_another_model_is_refused_at_registration(cluster, tiny_model):
    a = cluster.procs["coord-a"]
    other = cluster.start("other-model", "decode", "--coordinator", a.address, model_dir=tiny_model("qwen2"),
                          metrics=False, wait=False)
    assert other.popen.wait(120) != 0
    log = other.log.read_text()
    assert "refused this worker" in log and "serves model" in log and "but the pool serves" in log
    assert all(w.address != other.address for w in list_workers(a))
    # the pool is unchanged: the survivor still serves
    assert len(generate(a.address, request(PROMPTS[0], 5))) == 5
