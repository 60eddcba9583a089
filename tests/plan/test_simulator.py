"""The simulator on scripted workloads: deterministic arrivals and step times give queueing results a
hand calculation checks (times are sums of powers of two: exact in floating point)."""

from __future__ import annotations

import pytest

from pdserve.server.plan.cluster import ClusterSpec, CoordinatorSpec, simulate
from pdserve.server.plan.profile import DecodeCost, HandoffCost, PrefillCost, Profile
from pdserve.server.plan.workers import DecodeSpec, PrefillSpec
from pdserve.server.prefill.shapes import bucket_length
from pdserve.server.plan.workload import SimRequest


def profile(prefill=PrefillCost(0.25, 0.0), decode=DecodeCost(0.0625, 0.0), handoff=HandoffCost(0.0, 1e30, 0),
            kv_cache_tokens=4096, overhead=0.0) -> Profile:
    return Profile("scripted", "m", prefill, decode, handoff, kv_cache_tokens, "scripted", overhead)


def requests(n: int, gap: float, prompt_len: int = 16, output_len: int = 3, first_id: int = 10) -> list[SimRequest]:
    return [SimRequest(gap * i, tuple(range(first_id + 1000 * i, first_id + 1000 * i + prompt_len)), output_len)
            for i in range(n)]


def ttfts(result) -> list[float]:
    return [o.ttft for o in result.outputs]


def test_one_prefill_worker_queues_and_packs_what_waits():
    """Steps of 0.25 s; arrivals every 0.125 s. r0 runs alone [0, 0.25]; r1 (0.125) and r2 (0.25, which
    arrives as the step ends) pack into [0.25, 0.5]; r3 (0.375) runs [0.5, 0.75]. Decode steps of 1/16 s:
    two more tokens after the first."""
    result = simulate(requests(4, 0.125), ClusterSpec(), profile())
    assert ttfts(result) == [0.25, 0.375, 0.25, 0.375]
    assert [o.chunk_times for o in result.outputs] == [
        [0.25, 0.3125, 0.375], [0.5, 0.5625, 0.625], [0.5, 0.625, 0.6875], [0.75, 0.8125, 0.875]]
    s = result.summary()
    assert s["ttft_ms"]["median"] == 312.5 and s["ttft_ms"]["p99"] == pytest.approx(375.0)
    assert s["completed"] == 4 and s["duration_s"] == 0.875
    assert s["sim"]["utilisation"]["prefill-0"] == 0.75 / 0.875
    assert s["sim"]["prefill_computed_tokens"] == 64


def test_r2_decodes_beside_r1_so_its_tokens_wait_for_the_shared_step():
    """A per-sequence decode cost: a batch of two takes 0.125 s, of one 0.0625 s. r1's and r2's KV both
    arrive at 0.5; r1's first: the idle decode loop starts a step with r1 alone [0.5, 0.5625] (as the real
    loop runs what is ready); r2 joins the next [0.5625, 0.6875], which ends r1; r2 alone [0.6875, 0.75]."""
    p = profile(decode=DecodeCost(0.0, 0.0625))
    result = simulate(requests(3, 0.125), ClusterSpec(), p)
    assert [o.chunk_times for o in result.outputs] == [
        [0.25, 0.3125, 0.375], [0.5, 0.5625, 0.6875], [0.5, 0.6875, 0.75]]
    s = result.summary()
    assert s["tpot_ms"]["median"] == 93.75  # r0 62.5, r1 (0.6875 - 0.5) / 2, r2 125
    assert s["itl_ms"]["n"] == 6


def test_handoff_and_overhead_delay_what_they_should():
    """The first token is the client's at prefill end + ttft_overhead; decode starts after the handoff
    (0.125 s + 16 tokens x 4 bytes at 512 B/s = 0.25 s)."""
    p = profile(handoff=HandoffCost(0.125, 512.0, 4), overhead=0.0625)
    result = simulate(requests(1, 0.0), ClusterSpec(), p)
    assert result.outputs[0].chunk_times == [0.3125, 0.5625 + 0.0625, 0.6875]
    assert result.kv_wire_bytes == 64


def test_chunked_prefill_takes_whole_blocks_per_step():
    """--max-num-batched-tokens 32: a 40-token prompt runs as 32 then 8 tokens; step cost 1/64 s per
    padded token: 0.5 s, then 0.25 s (8 tokens pad to the 16 bucket)."""
    p = profile(prefill=PrefillCost(0.0, 1 / 64))
    spec = ClusterSpec(prefill=PrefillSpec(max_batch_tokens=32), decode=DecodeSpec())
    result = simulate(requests(1, 0.0, prompt_len=40, output_len=1), spec, p)
    assert ttfts(result) == [0.75]
    assert result.summary()["sim"]["prefill_computed_tokens"] == 40


def test_colocated_steps_cost_prefill_plus_decode():
    """One worker: r0 prefills [0, 0.25]; then each step is r0's decode (1/16) plus the next prefill (1/4)."""
    result = simulate(requests(4, 0.125), ClusterSpec(prefill_workers=0, colocated=True), profile())
    assert [o.chunk_times for o in result.outputs] == [
        [0.25, 0.5625, 0.875], [0.5625, 0.875, 0.9375], [0.5625, 0.875, 0.9375], [0.875, 0.9375, 1.0]]
    assert result.kv_wire_bytes == 0


def test_blocks_bound_admission_and_a_full_pool_queues_on_a_worker():
    """Two decode workers of 3 blocks (48 tokens); a 32-token prompt + 3 outputs needs 2 then 3 blocks, so
    each worker holds one request. r0 -> decode-0, r1 -> decode-1 (most free blocks, counting what the
    coordinator reserved since the last report); r2 fits nowhere and goes to the shortest worker queue
    (decode-0, the first of a tie), which admits it when r0 retires at 0.1875. Prefill 1/16 s a step: r0
    runs alone [0, 1/16] (it was queued first), r1 [1/16, 1/8], r2 [3/16, 1/4]."""
    spec = ClusterSpec(decode_workers=2, decode=DecodeSpec(kv_cache_tokens=48),
                       coordinator=CoordinatorSpec(decode_policy="most-free-blocks"))
    result = simulate(requests(3, 0.0, prompt_len=32), spec, profile(prefill=PrefillCost(0.0625, 0.0)))
    assert [o.chunk_times for o in result.outputs] == [
        [0.0625, 0.125, 0.1875], [0.125, 0.1875, 0.25], [0.25, 0.3125, 0.375]]
    assert result.busy_seconds == {"prefill-0": 0.1875, "decode-0": 0.25, "decode-1": 0.125}


def test_preemption_when_blocks_run_out_mid_decode():
    """One decode worker of 3 blocks of 16. r0 (16 + 8 tokens) takes its second block at its 17th token;
    r1 (16 + 3), started at 1/8, needs a second block too and none is free: it is preempted (the last
    admitted goes first) and readmitted when r0 retires at 0.5. Its prompt block stayed in the prefix
    cache, so nothing is prefilled again: steps [0.5, 0.5625] and [0.5625, 0.625]."""
    p = profile(prefill=PrefillCost(0.0625, 0.0), decode=DecodeCost(0.0625, 0.0, per_resumed_token_s=1 / 256))
    work = [SimRequest(0.0, tuple(range(10, 26)), 8), SimRequest(0.0, tuple(range(100, 116)), 3)]
    result = simulate(work, ClusterSpec(decode=DecodeSpec(kv_cache_tokens=48)), p)
    assert result.preemptions == 1
    r0, r1 = result.outputs
    assert r0.chunk_times == [0.0625 * k for k in range(1, 9)]
    assert r1.chunk_times == [0.125, 0.5625, 0.625]


def test_expected_wait_admission_refuses_past_the_ttft_budget():
    """--ttft-budget 0.5 s; prefill 0.25 s a step, one prompt a step; arrivals every 1/16 s. Until the
    worker's first report with a measured rate (0.5 s, after the arrival due then) nothing is known and
    every request is admitted (prefill_estimate.py); from then on each one's expected wait is far past
    its budget: refused with RESOURCE_EXHAUSTED and the estimate."""
    spec = ClusterSpec(prefill=PrefillSpec(max_batch_size=1), coordinator=CoordinatorSpec(ttft_budget=0.5))
    result = simulate(requests(16, 0.0625, output_len=1), spec, profile())
    assert [o.success for o in result.outputs] == [True] * 9 + [False] * 7
    assert [o.ttft for o in result.outputs[:9]] == [0.25 + 0.1875 * k for k in range(9)]  # one step each, 1/4 apart
    assert all(o.error.startswith("RESOURCE_EXHAUSTED: expected prefill wait") for o in result.outputs[9:])


def test_same_inputs_same_results():
    from pdserve.server.plan.arrivals import LoadSpec
    from pdserve.server.plan import datasets
    from pdserve.server.plan.workload import from_bench_requests

    reqs = datasets.synthetic(50, input_len=64, output_len=8, vocab_size=500, dist="lognormal", seed=3)
    work = from_bench_requests(reqs, LoadSpec(rate=20.0, seed=3), max_requests=50, duration=None)
    p = profile(prefill=PrefillCost(0.001, 1e-4), decode=DecodeCost(0.002, 1e-4, 1e-7))
    a, b = simulate(work, ClusterSpec(), p).summary(), simulate(work, ClusterSpec(), p).summary()
    assert a["ttft_ms"] == b["ttft_ms"] and a["completed"] == 50


def test_the_prefill_tiers_prefix_kv_skips_a_cached_prefix():
    """Two prompts of 40 tokens sharing their first 32 (two blocks): the second starts after them (the
    engine always computes at least the last token), so it prefills 8 tokens. Cost 1/64 s per padded token
    (buckets of 16 up): r0 40 -> 64 padded = 1 s; r1, arriving at 2 s, 8 -> 16 padded = 0.25 s. Without the
    cache (--prefix-cache-bytes 0) r1 takes 1 s too."""
    shared = tuple(range(10, 42))
    work = [SimRequest(0.0, shared + tuple(range(100, 108)), 1), SimRequest(2.0, shared + tuple(range(200, 208)), 1)]
    p = profile(prefill=PrefillCost(0.0, 1 / 64), handoff=HandoffCost(0.0, 1e30, 16))
    on = simulate(work, ClusterSpec(), p)
    assert ttfts(on) == [1.0, 0.25] and on.prefill_tokens == 48
    off = simulate(work, ClusterSpec(prefill=PrefillSpec(prefix_cache_bytes=0)), p)
    assert ttfts(off) == [1.0, 1.0] and off.prefill_tokens == 80
