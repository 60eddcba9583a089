"""Prefill rates per bucket: measured, smoothed, reported, and turned into seconds of queued work."""

from __future__ import annotations

from pdserve.server.prefill.rates import PrefillRates, bucket_of, queued_seconds, rate_of, seconds_of


def test_rates_are_smoothed_per_bucket_and_reported_with_the_queue():
    rates = PrefillRates([16, 32, 64], smoothing=0.5)
    rates.record(16, 64, 0.5)  # 128 tokens/s
    rates.record(16, 32, 0.125)  # 256: halfway -> 192
    rates.record(64, 50, 0.0)  # no time: ignored
    report = rates.report({16: 40, 64: 100}, {16: 2, 64: 1})
    assert [(b.max_tokens, b.queued_tokens, b.queued_prompts, b.tokens_per_second) for b in report] == [
        (16, 40, 2, 192.0), (32, 0, 0, 0.0), (64, 100, 1, 0.0)]
    assert not any(b.HasField("expected_wait_seconds") for b in report)  # what an older worker sends
    report = rates.report({16: 40, 64: 100}, {16: 2, 64: 1}, waits={16: 0.25, 32: 0.5, 64: 2.0})
    assert [b.expected_wait_seconds for b in report if b.HasField("expected_wait_seconds")] == [0.25, 0.5, 2.0]


def test_seconds_use_the_nearest_measured_bucket_and_none_without_any():
    rates = PrefillRates([16, 32, 64, 128])
    rates.record(16, 128, 1.0)
    rates.record(128, 64, 1.0)
    buckets = rates.report({16: 256, 64: 96, 128: 32}, {})
    assert [bucket_of(buckets, n) for n in (1, 16, 17, 100, 128, 5000)] == [0, 0, 1, 3, 3, 3]
    assert rate_of(buckets, 1) == 128.0 and rate_of(buckets, 2) == 64.0  # 32: nearest is 16; 64: nearest is 128
    tie = PrefillRates([16, 32, 64])
    tie.record(16, 100, 1.0)
    tie.record(64, 50, 1.0)
    assert rate_of(tie.report({}, {}), 1) == 50.0  # equally near: the longer bucket's (the slower, usually)
    assert seconds_of(buckets, [(0, 256), (2, 96)]) == 2.0 + 1.5
    assert queued_seconds(buckets) == 256 / 128 + 96 / 64 + 32 / 64
    assert seconds_of(PrefillRates([16]).report({16: 10}, {}), [(0, 10)]) is None
    assert queued_seconds(PrefillRates([16]).report({16: 10}, {})) == 0.0


def test_the_schedulers_seconds_use_the_nearest_measured_bucket_and_0_without_any():
    rates = PrefillRates([16, 32, 64])
    assert rates.seconds(32, 100) == 0.0  # nothing measured: due times change nothing
    rates.record(16, 128, 1.0)
    rates.record(64, 50, 1.0)
    assert rates.seconds(16, 64) == 0.5
    assert rates.seconds(32, 100) == 2.0  # equally near 16 and 64: the longer bucket's 50 tokens/s
    assert rates.seconds(4096, 100) == 2.0  # past the last bucket: the last one's
    assert rates.seconds(64, 0) == 0.0
