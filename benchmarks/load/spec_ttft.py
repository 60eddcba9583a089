"""What a draft model (draft_model speculation) costs the first tokens, through served clusters: TTFT and the time
to the second token, with the draft on and off, in one run.

    .venv/bin/python -m pdserve.benchmarks.load.spec_ttft [--model DIR] [--draft DIR] [--requests 20] [--prompt-len 256]

Two `pdserve up` clusters (one prefill worker, one decode worker each) run side by side: one without speculation,
one with '{"method": "draft_model", "model": DRAFT, "num_speculative_tokens": K}'. Requests go one at a time,
alternating between the clusters (off, on, off, ...), so both see the same machine; each is a fresh random prompt
(no prefix-cache hit), greedy, `--max-tokens` long. The decode worker computes the draft's prompt KV in a thread
from the prompt ids while the target's KV arrives from the prefill worker (`server/decode/spec/draft.py`); the
first token comes from the prefill worker, so TTFT should not move, and the second token shows what the draft's
catch-up costs. Default draft: a random Llama of server/model/tiny.py's DRAFT_SHAPE with the model's tokenizer
(`spec_decode.small_draft`). Prints each request's figures as it goes and the medians at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

from pdserve.benchmarks.engine.spec_decode import EMBEDDED, small_draft
from pdserve.benchmarks.servers import pdserve_up
from pdserve.server.client import build_request, stream
from pdserve.server.model.config import load_config


@contextmanager
def cluster(model: Path, workdir: Path, extra: list[str]):
    """`pdserve up` with one prefill and one decode worker (`up.pdserve_up`); yields the coordinator's address."""
    try:
        with pdserve_up(model, workdir, extra_args=extra) as up:
            yield up.grpc
    except RuntimeError as e:
        raise SystemExit(str(e)) from e


def first_tokens(addr: str, prompt: list[int], max_tokens: int) -> tuple[float, float, list[int]]:
    """(seconds to the first token, to the second, the tokens) of one greedy request."""
    t0 = time.perf_counter()
    times, tokens = [], []
    for msg in stream(addr, build_request(token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                      timeout=300):
        for t in msg.token_ids:
            tokens.append(t)
            times.append(time.perf_counter() - t0)
    return times[0], times[1], tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=EMBEDDED)
    ap.add_argument("--draft", type=Path, help="default: a random small Llama sharing the model's tokenizer")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--requests", type=int, default=20, help="per cluster")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="spec-ttft-"))
    draft = args.draft or small_draft(args.model, work / "draft")
    spec = json.dumps({"method": "draft_model", "model": str(draft), "num_speculative_tokens": args.k})
    vocab = load_config(args.model).vocab_size
    rng = random.Random(0)
    figures: dict[str, list[tuple[float, float]]] = {"off": [], "draft": []}
    same = True
    print(f"starting two clusters (off, draft {draft}) in {work} ...", flush=True)
    with ExitStack() as stack:
        addrs = {"off": stack.enter_context(cluster(args.model, work / "off", [])),
                 "draft": stack.enter_context(cluster(args.model, work / "draft-on", ["--speculative-config", spec]))}
        for name, addr in addrs.items():  # warm-up: the first request of a cluster pays its lazy starts
            first_tokens(addr, [rng.randrange(3, vocab) for _ in range(args.prompt_len)], args.max_tokens)
        for i in range(args.requests):
            prompt = [rng.randrange(3, vocab) for _ in range(args.prompt_len)]
            outputs = {}
            for name in (("off", "draft") if i % 2 == 0 else ("draft", "off")):
                ttft, second, outputs[name] = first_tokens(addrs[name], prompt, args.max_tokens)
                figures[name].append((ttft, second))
            same &= outputs["off"] == outputs["draft"]
            print(f"request {i + 1}/{args.requests}: TTFT off {figures['off'][-1][0] * 1e3:.1f} ms, draft "
                  f"{figures['draft'][-1][0] * 1e3:.1f} ms; second token off {figures['off'][-1][1] * 1e3:.1f} ms, "
                  f"draft {figures['draft'][-1][1] * 1e3:.1f} ms", flush=True)
    med = {name: (statistics.median(f[0] for f in fs), statistics.median(f[1] for f in fs))
           for name, fs in figures.items()}
    ratio_ttft = statistics.median(on[0] / off[0] for off, on in zip(figures["off"], figures["draft"]))
    ratio_second = statistics.median(on[1] / off[1] for off, on in zip(figures["off"], figures["draft"]))
    print(f"median TTFT: off {med['off'][0] * 1e3:.1f} ms, draft {med['draft'][0] * 1e3:.1f} ms (x{ratio_ttft:.3f}, "
          f"median of per-prompt ratios); second token: off {med['off'][1] * 1e3:.1f} ms, draft "
          f"{med['draft'][1] * 1e3:.1f} ms (x{ratio_second:.3f}); same tokens: {same}; load {os.getloadavg()}",
          flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"figures": figures, "median": med, "ttft_ratio": ratio_ttft,
                                        "second_token_ratio": ratio_second, "same_tokens": same,
                                        "load": os.getloadavg()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
