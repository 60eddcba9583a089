"""`plan profile`'s fit: rows made from known step costs give those costs back."""

from __future__ import annotations

import pytest

from pdserve.benchmarks.plan.fit import nonneg_fit
from pdserve.benchmarks.plan.measure import fit_profile
from pdserve.server.prefill.shapes import bucket_length


def test_nonneg_fit_drops_a_negative_column():
    assert nonneg_fit({"one": [1, 1, 1], "x": [1, 2, 3]}, [3, 5, 7]) == pytest.approx({"one": 1.0, "x": 2.0})
    # y falls with x: a step never gets faster with more work, so x is dropped and the mean remains
    assert nonneg_fit({"one": [1, 1], "x": [1, 2]}, [2, 1], relative=False) == pytest.approx({"one": 1.5, "x": 0.0})
    # relative errors: the constant c minimising ((c - 2) / 2)^2 + ((c - 1) / 1)^2 is (1/2 + 1) / (1/4 + 1)
    assert nonneg_fit({"one": [1, 1], "x": [1, 2]}, [2, 1]) == pytest.approx({"one": 1.2, "x": 0.0})


def test_fit_profile_recovers_the_costs_it_was_made_with():
    fixed, per_token, overhead = 0.004, 1e-5, 0.003
    d0, d1, d2 = 0.002, 1e-4, 1e-7
    handoff_fixed, bpt, bw = 0.001, 1000, 1e9

    def prefill(n: int) -> float:
        return fixed + per_token * bucket_length(n, 512)

    def decode(batch: int, context: int) -> float:
        return d0 + d1 * batch + d2 * context

    rows = {
        "prefill": [{"tokens": n, "ttft_s": overhead + prefill(n),
                     "second_s": overhead + prefill(n) + handoff_fixed + n * bpt / bw + decode(1, n + 1)}
                    for n in (16, 64, 128, 256, 448) for _ in range(3)],
        "burst": [{"prompts": 5, "tokens": 16, "first_s": overhead + prefill(16),
                   "last_s": overhead + prefill(16) + prefill(64)}],
        "decode": [{"batch": b, "prompt": p, "tokens": 32, "context_tokens": b * (p + 16),
                    "step_s": decode(b, b * (p + 16))} for b in (1, 4, 16) for p in (32, 320)],
    }
    p = fit_profile(rows, hardware="cpu", model="tiny", kv_bytes_per_token=bpt, kv_cache_tokens=4096,
                    transfer_bytes_per_s=bw, max_len=512)
    assert p.prefill.fixed_s == pytest.approx(fixed) and p.prefill.per_token_s == pytest.approx(per_token)
    assert p.prefill.per_pair_s == pytest.approx(0.0, abs=1e-15)
    assert p.ttft_overhead_s == pytest.approx(overhead)
    assert (p.decode.fixed_s, p.decode.per_seq_s, p.decode.per_context_token_s) == pytest.approx((d0, d1, d2))
    assert p.handoff.fixed_s == pytest.approx(handoff_fixed)


def test_decode_steps_are_work_the_share_times_the_wall_and_groups_without_overlap_are_not_fitted():
    from pdserve.benchmarks.plan.measure import fit_decode

    d0, d1 = 0.002, 1e-4
    rows = [{"batch": b, "context_tokens": 0, "step_s": (d0 + d1 * b) / share, "share": share, "overlap": True}
            for b, share in ((1, 0.5), (8, 1.0), (64, 0.25))]
    rows.append({"batch": 32, "context_tokens": 0, "step_s": 1.0, "share": 1.0, "overlap": False})
    d = fit_decode(rows, per_resumed_token_s=1e-5)
    assert (d.fixed_s, d.per_seq_s, d.per_context_token_s, d.per_resumed_token_s) == pytest.approx((d0, d1, 0, 1e-5))
    with pytest.raises(ValueError, match="decode_tokens"):
        fit_decode(rows[3:], 0.0)


def test_host_cpu_per_request_and_per_token():
    """32 one-token requests cost the coordinator 64 ms (2 ms each); a group of 8 x 96 tokens 16 ms of requests
    + 768 x 0.5 ms; the prefill worker's 3 CPU seconds over its busiest thread's 2 s: 1.5 cores (at most this
    machine's); the decode worker: one core (its step is its process's CPU, threads in turn)."""
    from pdserve.benchmarks.plan.measure import host_cpu

    rows = {"front": [{"requests": 32, "tokens": 32, "cpu_s": {"coordinator": 0.064, "client": 0.032}}],
            "decode": [{"batch": 8, "tokens": 96, "cpu_s": {"coordinator": 0.016 + 768 * 0.0005,
                                                            "client": 0.008 + 768 * 0.00025, "decode": 1.2},
                        "decode_hot_cpu_s": 0.8},
                       {"batch": 1, "tokens": 96, "cpu_s": {"coordinator": 9.0, "client": 9.0}}],  # too few: not used
            "prefill_cpu": {"cpu_s": 3.0, "ttft_sum_s": 4.0, "hot_cpu_s": 2.0}}
    h = host_cpu(rows)
    assert (h.coordinator.per_request_s, h.coordinator.per_token_s) == pytest.approx((0.002, 0.0005))
    assert (h.client.per_request_s, h.client.per_token_s) == pytest.approx((0.001, 0.00025))
    import os

    assert (h.prefill_threads, h.decode_threads) == pytest.approx((min(1.5, os.cpu_count() or 1), 1.0))
    assert h.cores is None


def test_a_decode_step_is_the_decode_process_cpu_per_step_where_measured():
    """96 steps in 5.76 s of the decode process's CPU: 60 ms each, though the wall said 90 ms at a share of
    0.3; without CPU, wall x share; never more than the wall."""
    from pdserve.benchmarks.plan.measure import step_work

    assert step_work({"tokens": 96, "step_s": 0.09, "share": 0.3, "cpu_s": {"decode": 5.76}}) == pytest.approx(0.06)
    assert step_work({"tokens": 96, "step_s": 0.09, "share": 0.5}) == pytest.approx(0.045)
    assert step_work({"tokens": 96, "step_s": 0.05, "share": 0.5, "cpu_s": {"decode": 5.76}}) == 0.05


def test_per_request_cpu_is_taken_out_of_the_steps_and_fitted_against_the_prompt():
    """Rows made with known per-request CPU on both workers (the KV sent and received, the RPCs) beside known
    steps: the fit gives both back, and the decode steps' work loses its requests' share."""
    from pdserve.benchmarks.plan.measure import fit_decode, fit_profile

    d0, d1, d2, r0, r1 = 0.002, 1e-4, 1e-7, 0.003, 2e-5  # decode step; decode per request: 3 ms + 20 us/token
    p0, p1, q0, q1 = 0.004, 1e-5, 0.001, 5e-6  # prefill step; prefill per request: 1 ms + 5 us/token
    idle = 0.01  # cores each worker burns idle (heartbeats)

    def step(batch, context):
        return d0 + d1 * batch + d2 * context

    tokens = 32
    groups = [{"batch": b, "prompt": p, "tokens": tokens, "context_tokens": b * (p + 16), "share": 1.0,
               "step_s": 1.0,  # the wall: far above the CPU, which is what counts
               "cpu_s": {"decode": tokens * step(b, b * (p + 16)) + b * (r0 + r1 * p), "coordinator": 0.0,
                         "client": 0.0}}
              for b in (1, 4, 16) for p in (32, 320)]
    requests = [{"prompt": n, "requests": 16, "wall_s": 2.0, "idle_cores": {"decode": idle, "prefill": idle},
                 "cpu_s": {"decode": 16 * (r0 + r1 * n + step(1, n + 1)) + idle * 2.0,
                           "prefill": 16 * (q0 + q1 * n + p0 + p1 * bucket_length(n, 512)) + idle * 2.0}}
                for n in (16, 384)]
    d = fit_decode(groups, 0.0, requests)
    assert (d.fixed_s, d.per_seq_s, d.per_context_token_s) == pytest.approx((d0, d1, d2), rel=1e-6)
    assert (d.per_request_s, d.per_request_token_s) == pytest.approx((r0, r1), rel=1e-6)
    without = fit_decode(groups, 0.0)  # the requests' CPU lands in the steps
    assert without.per_seq_s > d1 and without.per_request_s == 0.0
    rows = {"prefill": [{"tokens": n, "ttft_s": p0 + p1 * bucket_length(n, 512), "second_s": 1.0}
                        for n in (16, 64, 256)],
            "burst": [], "decode": groups, "requests": requests}
    p = fit_profile(rows, hardware="cpu", model="tiny", kv_bytes_per_token=1000, kv_cache_tokens=4096,
                    transfer_bytes_per_s=1e9, max_len=512)
    assert (p.prefill.per_request_s, p.prefill.per_request_token_s) == pytest.approx((q0, q1), rel=1e-6)
    assert p.decode.request_seconds(100) == pytest.approx(r0 + 100 * r1, rel=1e-6)


def test_prefill_rows_measured_idle_keep_their_time_and_give_the_cores_the_prefill_keeps_busy():
    """On an idle cluster (background 0) a prompt's time is its work: the busiest thread's share (XLA's threads
    waiting for each other) is not divided out; the prefill's threads are its CPU over its prompts' time."""
    from pdserve.benchmarks.plan.measure import host_cpu

    fixed, per_token = 0.004, 1e-4

    def row(n: int, background: int) -> dict:
        return {"tokens": n, "ttft_s": fixed + per_token * bucket_length(n, 512), "second_s": 1.0, "share": 0.4,
                "decode_share": 0.5, "background": background}

    def fit(background: int):
        rows = {"prefill": [row(n, background) for n in (16, 64, 256)], "burst": [],
                "decode": [{"batch": 1, "prompt": 16, "tokens": 32, "context_tokens": 32, "step_s": 0.002}],
                "prefill_cpu": {"cpu_s": 1.5, "ttft_sum_s": 1.0, "hot_cpu_s": 0.5, "background": background}}
        return fit_profile(rows, hardware="cpu", model="tiny", kv_bytes_per_token=1000, kv_cache_tokens=4096,
                           transfer_bytes_per_s=1e9, max_len=512), host_cpu(rows)

    idle, idle_host = fit(0)
    assert (idle.prefill.fixed_s, idle.prefill.per_token_s) == pytest.approx((fixed, per_token))
    assert idle_host.prefill_threads == pytest.approx(1.5)  # 1.5 CPU seconds over 1 s of prompts
    loaded, loaded_host = fit(8)
    assert loaded.prefill.per_token_s == pytest.approx(0.4 * per_token)  # the share divided out under load
    assert loaded_host.prefill_threads == pytest.approx(min(3.0, __import__("os").cpu_count()))
