"""Repeat-prompt TTFT with the host offload tier and without, when neither tier's memory holds two prompts' KV.

    .venv/bin/python -m pdserve.benchmarks.kv.offload_ttft [--model DIR] [--prompt 400] [--rounds 5]
        [--up-args '--decode-weight-dtype float32']

Two `pdserve up` clusters (one prefill, one decode worker each) run side by side: "host" with
`--kv-offloading-size 1` (1 GiB of host memory under both tiers' prefix caches), "none" without. Both get a decode KV
cache and a prefill prefix KV too small for two prompts (`--kv-cache-memory`, `--prefix-cache-bytes`). Two prompts A
and B alternate, A B A B ...: each evicts the other's blocks from both tiers' memory, so every request after the
first two repeats a prompt whose KV was evicted. With the host tier, the decode worker loads those blocks back at
admission and the prefill worker its prefix KV (it computes only the last partial block); without, the prefill worker
computes the whole prompt and sends every block. Requests alternate between the clusters over the same token ids.
Prints each request's TTFT as it goes, and the median repeat TTFT of each cluster and their ratio at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import urllib.request
from contextlib import ExitStack
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from pdserve.benchmarks.clients import greedy_ttft as ttft
from pdserve.benchmarks.servers import pdserve_up
from pdserve.benchmarks.engine.spec_decode import EMBEDDED
from pdserve.server.launcher import free_port
from pdserve.server.model.tokenizer import Tokenizer

TEXT = Path(json.__file__).read_text()
"""Where the prompts' tokens come from: stdlib source, as the embedded model was trained on."""


def counters(metrics_url: str) -> dict[str, float]:
    """Prompt tokens the prefill tier computed, and blocks each tier loaded from its offload tiers, so far."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    out = {"prefill_computed": 0.0, "prefill_offload_hits": 0.0, "decode_offload_hits": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            role = s.labels.get("role")
            if family.name == "pdserve_prefill_computed_tokens" and s.name.endswith("_total") and role == "prefill":
                out["prefill_computed"] += s.value
            elif family.name == "pdserve_kv_offload_hits" and role in ("prefill", "decode"):
                out[f"{role}_offload_hits"] += s.value
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=EMBEDDED)
    ap.add_argument("--prompt", type=int, default=400, help="tokens of each of the two prompts")
    ap.add_argument("--answer", type=int, default=8, help="answer tokens of each request")
    ap.add_argument("--rounds", type=int, default=5, help="A B pairs after the first")
    ap.add_argument("--kv-cache-memory", default="1MiB", help="the decode KV cache (must hold one prompt, not two)")
    ap.add_argument("--prefix-cache-bytes", type=int, default=1 << 19, help="the prefill worker's prefix KV")
    ap.add_argument("--up-args", default="", help="more `pdserve up` flags for both clusters")
    args = ap.parse_args(argv)
    ids = Tokenizer.from_dir(args.model).encode(TEXT)
    prompts = [ids[: args.prompt], ids[args.prompt : 2 * args.prompt]]
    small = ["--kv-cache-memory", args.kv_cache_memory, "--prefix-cache-bytes", str(args.prefix_cache_bytes),
             *args.up_args.split()]
    rows = []
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        clusters = {}
        for mode, extra in (("host", ["--kv-offloading-size", "1"]), ("none", [])):
            print(f"== starting the {mode} cluster", file=sys.stderr, flush=True)
            port = free_port()
            up = stack.enter_context(pdserve_up(args.model, Path(tmp) / mode,
                                                extra_args=[*small, *extra, "--metrics-port", str(port)]))
            clusters[mode] = (up.grpc, f"http://127.0.0.1:{port}/metrics")
        for addr, _ in clusters.values():  # warm both (compiles, first-call costs) on an unrelated prompt
            ttft(addr, ids[-args.prompt:], 2)
        answers: dict[tuple[str, int], list[int]] = {}
        for i in range(2 * (args.rounds + 1)):
            which = i % 2
            for mode, (addr, metrics_url) in clusters.items():
                before = counters(metrics_url)
                seconds, answer = ttft(addr, prompts[which], args.answer)
                after = counters(metrics_url)
                if answers.setdefault((mode, which), answer) != answer:
                    print(f"!! {mode}: prompt {'AB'[which]} answered differently on a repeat", flush=True)
                rows.append({"request": i, "prompt": "AB"[which], "mode": mode, "repeat": i >= 2, "ttft_s": seconds,
                             **{k: after[k] - before[k] for k in after}})
                print(json.dumps(rows[-1]), flush=True)
        if any(answers["host", w] != answers["none", w] for w in (0, 1)):
            print("!! the clusters' greedy answers differ", flush=True)
    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in rows if r["mode"] == mode and r["repeat"])

    print(f"\nrepeats of {args.prompt}-token prompts (median of {2 * args.rounds}): TTFT host tier "
          f"{med('host', 'ttft_s') * 1e3:.1f} ms, none {med('none', 'ttft_s') * 1e3:.1f} ms, ratio "
          f"{med('host', 'ttft_s') / med('none', 'ttft_s'):.2f}; prompt tokens the prefill tier computed "
          f"{med('host', 'prefill_computed'):.0f} / {med('none', 'prefill_computed'):.0f}; blocks loaded from the host "
          f"tier by prefill + decode {med('host', 'prefill_offload_hits'):.0f} + {med('host', 'decode_offload_hits'):.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
