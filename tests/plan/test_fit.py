"""`plan profile`'s fit: rows made from known step costs give those costs back."""

from __future__ import annotations

import pytest

from pdserve.benchmarks.plan.fit import nonneg_fit
from pdserve.benchmarks.plan.measure import fit_profile
from pdserve.benchmarks.plan.workers import bucket_length


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
