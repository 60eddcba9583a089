"""The coordinator relay benchmark runs end to end: fake workers, the baseline's and this coordinator."""

from __future__ import annotations

import json

from pdserve.benchmarks.load import coordinator as bench


def test_every_coordinator_relays_every_token_it_was_sent_without_errors(tmp_path):
    out = tmp_path / "relay.json"
    rows = bench.main(["--streams", "4", "--seconds", "1", "--warmup", "0.3", "--fronts", "grpc", "sse",
                       "--output-len", "50", "--sse-clients", "2", "--out", str(out)])
    assert [(r.coordinator, r.front) for r in rows] == [
        (c, f) for f in ("grpc", "sse") for c in ("before", "after", "per-event")]
    for r in rows:
        assert r.errors == 0, r.first_error
        assert r.mismatches == 0, r.first_mismatch
        assert r.tokens > 0 and r.messages > 0
        # streams of 50 tokens end in the window, each checked against what the workers sent
        assert r.requests > 0
        assert r.coordinator_cpu_s > 0 and r.client_cpu_s > 0 and r.busy > 0
        assert r.client_processes == (2 if r.front == "sse" else 1)  # the SSE streams spread over two
        # before: a response per token (and each end); this checkout merges the steps that piled up
        assert r.tokens <= r.messages or r.coordinator != "before"
    assert [r["coordinator"] for r in json.loads(out.read_text())["rows"]] == [r.coordinator for r in rows]
    assert (tmp_path / "coordinator-after-grpc-4.log").exists()
