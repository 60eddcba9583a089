"""A short real run of `pdserve bench` against `pdserve up` on the tiny model, and of the OpenAI target
against a minimal streaming HTTP server."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from pdserve.server.plan import datasets
from pdserve.benchmarks.bench import Group, run_groups
from pdserve.benchmarks.clients import OpenAITarget
from pdserve.server.plan.arrivals import LoadSpec
from tests.e2e.cluster import pdserve_up, wait_all_blocks_free

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    # Two coordinator processes share the public port (SO_REUSEPORT): the load below spreads over both.
    # One response per token, which the ITL count below relies on: per-request decode streams (a batched
    # Steps stream joins the steps a slower coordinator has not read yet) and --max-coalesce 1 (adaptive
    # coalescing merges the tokens of a client stream that falls behind); both did under the full suite.
    with pdserve_up(
        tiny_model("llama"), tmp_path_factory.mktemp("bench-up"), prefill_workers=1, decode_workers=1,
        extra_args=["--coordinators", "2", "--decode-streams", "per-request", "--max-coalesce", "1"],
    ) as state:
        assert state["coordinators"] == 2 and len([n for n in state["pids"] if n.startswith("coordinator")]) == 2
        yield state


def test_pdserve_bench_against_pdserve_up(cluster, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve.server.cli",
            "bench",
            "--target",
            "grpc",
            "--addr",
            cluster["coordinator"],
            "--num-prompts",
            "12",
            "--request-rate",
            "20",
            "--arrival",
            "poisson",
            "--concurrency",
            "4",
            "--input-len",
            "24",
            "--output-len",
            "6",
            "--vocab-size",
            "500",
            "--seed",
            "7",
            "--warmup",
            "2",
            "--slo-ttft-ms",
            "60000",
            "--slo-tpot-ms",
            "60000",
            "--timeout",
            "120",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "output throughput" in proc.stdout
    doc = json.loads((out / "results.json").read_text())
    s = doc["summary"]
    assert (s["requests"], s["completed"], s["failed"]) == (12, 12, 0)
    assert (s["prompt_tokens"], s["output_tokens"]) == (12 * 24, 12 * 6)  # the server's usage, ignore_eos
    assert s["good_requests"] == 12 and s["slo_attainment"] == 1.0
    assert s["ttft_ms"]["n"] == 12 and s["tpot_ms"]["n"] == 12
    assert s["itl_ms"]["n"] == 12 * 5  # one chunk per token: 5 gaps per request
    assert 0 < s["ttft_ms"]["median"] <= s["ttft_ms"]["p99"] <= s["e2el_ms"]["p99"]
    assert [r["output_len"] for r in doc["requests"]] == [6] * 12
    assert doc["config"]["load"]["concurrency"] == 4
    for png in ("latency_cdf.png", "throughput.png"):
        assert (out / png).read_bytes()[:8] == PNG
    pairs = wait_all_blocks_free(cluster["decode"])
    assert all(free == total > 0 for free, total in pairs), pairs  # nothing stranded after the run


async def _fake_openai(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Just enough of /v1/completions (stream) and /v1/models: one SSE chunk per token, then usage."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    length = next(
        (int(v) for k, _, v in (ln.partition(": ") for ln in lines) if k.lower() == "content-length"), 0
    )
    body = json.loads(await reader.readexactly(length)) if length else {}
    if lines[0].startswith("GET /v1/models"):
        payload = json.dumps({"data": [{"id": "fake-model"}]}).encode()
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(payload)
            + payload
        )
    else:
        assert (
            body["model"] == "fake-model"
            and body["stream"]
            and body["temperature"] == 0.0
            and body["ignore_eos"]
        )
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        )

        def event(obj) -> bytes:
            data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
            return b"%x\r\n%s\r\n" % (len(data), data)

        n = body["max_tokens"]
        for i in range(n):
            await asyncio.sleep(0.002)
            writer.write(
                event({"choices": [{"text": f"t{i}", "finish_reason": "length" if i == n - 1 else None}]})
            )
            await writer.drain()
        writer.write(
            event({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}})
        )
        writer.write(event(b"[DONE]") + b"0\r\n\r\n")
    await writer.drain()
    writer.close()


async def test_openai_target_streams_and_counts():
    server = await asyncio.start_server(_fake_openai, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    target = OpenAITarget(f"http://127.0.0.1:{port}", timeout=30)
    try:
        reqs = datasets.synthetic(4, input_len=9, output_len=5, vocab_size=300, seed=2)
        result = await run_groups(
            target, [Group("default", reqs, LoadSpec(concurrency=2), max_requests=6)], progress=False
        )
    finally:
        await target.close()
        server.close()
        await server.wait_closed()
    assert [
        (o.success, o.prompt_len, o.output_len, len(o.chunk_times), o.finish_reason) for o in result.outputs
    ] == [(True, 9, 5, 5, "length")] * 6
    assert all(len(o.itl) == 4 and o.ttft > 0 for o in result.outputs)
