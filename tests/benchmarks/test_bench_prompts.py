"""`pdserve bench` sends no prompt twice in a timed run and warms up on prompts of its own: a repeated
prompt would be served from the server's prefix cache, and the run would measure the cache."""

from __future__ import annotations

import asyncio
import time

from pdserve.benchmarks import bench
from pdserve.benchmarks.clients import Target


class Recording(Target):
    """Answers at once with one token; records every prompt it was sent."""

    def __init__(self) -> None:
        self.prompts: list[tuple[int, ...]] = []

    async def send(self, request, out) -> None:
        self.prompts.append(request.prompt_ids)
        await asyncio.sleep(0)
        out.sent = time.perf_counter()
        out.chunk_times, out.chunk_tokens = [out.sent], [1]
        out.done, out.output_len, out.success = out.sent, 1, True

    async def close(self) -> None:
        pass


def test_a_timed_run_past_a_thousand_arrivals_sends_each_prompt_once(tmp_path, monkeypatch):
    recorded = Recording()
    monkeypatch.setattr(bench, "make_target", lambda _args: recorded)
    args = bench.build_parser().parse_args(["--no-plots", "--no-progress", "--out", str(tmp_path), "--input-len", "8",
                                            "--output-len", "1", "--request-rate", "2000", "--duration", "0.8",
                                            "--warmup", "4", "--seed", "3"])
    assert bench.prompt_count(args) > 1600 + 6 * 40
    asyncio.run(bench._main(args))
    warm, sent = recorded.prompts[:4], recorded.prompts[4:]
    assert len(sent) > 1000  # more than the old fixed pool of 1000, which a timed run cycled through
    assert len(set(sent)) == len(sent) and not set(warm) & set(sent)
    first = bench.make_requests(args, 4)
    assert [r.prompt_ids for r in first] == sent[:4]  # the measured prompts are the seed's, as before


def test_prompt_counts():
    parse = bench.build_parser().parse_args
    assert bench.prompt_count(parse(["--num-prompts", "12"])) == 12
    assert bench.prompt_count(parse(["--duration", "10"])) == 1000  # a closed loop: no rate to count by
    assert bench.prompt_count(parse(["--duration", "20", "--request-rate", "67.2"])) == 1344 + 220 + 16
