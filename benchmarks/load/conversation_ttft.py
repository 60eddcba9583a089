"""What conditional disaggregation does to a conversation's later turns: TTFT by turn and the prompt tokens each tier
computes, with --conditional-disagg-max-uncached at its default (on) and 0 (off), in one run.

    .venv/bin/python -m pdserve.benchmarks.load.conversation_ttft [--model DIR] [--conversations 4] [--turns 4]
        [--up-args '--decode-weight-dtype float32']

Two `pdserve up` clusters (one prefill worker, one decode worker each) run side by side, one with the feature off.
Each conversation opens with a shared system prompt and a user turn; every later turn's prompt is the one before,
the model's answer (greedy, `--answer` tokens) and `--user` new tokens. Conversations run one at a time, their turns
alternating between the clusters (on, off, on, ...) over the same token ids, so both see the same machine and the
same prompts. Both keep the answer's KV on the decode worker (its prefix cache); on, the decode worker prefills a
later turn's uncached suffix itself; off, the prefill worker computes the prompt past its own prefix KV and sends the
blocks the decode worker lacks. Prints each turn's figures as it goes and the medians by turn at the end.
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

from pdserve.benchmarks.clients import greedy_ttft
from pdserve.server.client import build_request, stream
from pdserve.benchmarks.servers import pdserve_up
from pdserve.benchmarks.engine.spec_decode import EMBEDDED
from pdserve.server.launcher import free_port
from pdserve.server.model.tokenizer import Tokenizer

TEXT = Path(json.__file__).read_text()
"""Where the prompts' tokens come from: stdlib source, as the embedded model was trained on."""


def computed_tokens(metrics_url: str) -> dict[str, float]:
    """Prompt tokens computed so far, by role (prefill: the prefill worker; decode: local prefills)."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    out = {"prefill": 0.0, "decode": 0.0}
    for family in text_string_to_metric_families(text):
        if family.name == "pdserve_prefill_computed_tokens":
            for s in family.samples:
                if s.name.endswith("_total") and s.labels.get("role") in out:
                    out[s.labels["role"]] += s.value
    return out


def turn(addr: str, metrics_url: str, prompt: list[int], max_tokens: int) -> tuple[float, list[int], dict[str, float]]:
    """(seconds to the first token, the answer, the prompt tokens each tier computed) of one greedy request."""
    before = computed_tokens(metrics_url)
    ttft, tokens = greedy_ttft(addr, prompt, max_tokens)
    after = computed_tokens(metrics_url)
    return ttft, tokens, {k: after[k] - before[k] for k in after}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=EMBEDDED)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system", type=int, default=128, help="system prompt tokens, shared by every conversation")
    ap.add_argument("--user", type=int, default=32, help="new user tokens each turn")
    ap.add_argument("--answer", type=int, default=48, help="answer tokens each turn")
    ap.add_argument("--up-args", default="", help="more `pdserve up` flags for both clusters, e.g. "
                    "'--decode-weight-dtype float32' (then both clusters' greedy answers agree)")
    ap.add_argument("--out", type=Path, help="write every turn's figures here (JSON)")
    args = ap.parse_args(argv)
    ids = Tokenizer.from_dir(args.model).encode(TEXT)
    need = args.system + args.conversations * args.turns * args.user
    if len(ids) < need:
        raise SystemExit(f"the prompt text has {len(ids)} tokens, {need} needed: fewer --conversations or --turns")
    longest = args.system + args.turns * (args.user + args.answer)
    if longest > 512:
        print(f"note: the last turn reaches {longest} tokens; the model must allow that many", file=sys.stderr)
    system, rest = ids[: args.system], ids[args.system :]
    rows = []
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        clusters = {}
        for mode, extra in (("on", []), ("off", ["--conditional-disagg-max-uncached", "0"])):
            port = free_port()
            print(f"== starting the {mode} cluster", file=sys.stderr, flush=True)
            up = stack.enter_context(pdserve_up(args.model, Path(tmp) / mode,
                                                extra_args=[*extra, *args.up_args.split(), "--metrics-port",
                                                            str(port)]))
            clusters[mode] = (up.grpc, f"http://127.0.0.1:{port}/metrics")
        for mode, (addr, _) in clusters.items():  # warm both (compiles, first-call costs) on an unrelated prompt
            list(stream(addr, build_request(token_ids=rest[-200:], max_tokens=4, temperature=0.0, ignore_eos=True),
                        timeout=600))
        for c in range(args.conversations):
            prompt = {mode: list(system) for mode in clusters}
            for t in range(args.turns):
                start = (c * args.turns + t) * args.user
                for mode, (addr, metrics_url) in clusters.items():
                    prompt[mode] += rest[start : start + args.user]
                    ttft, answer, computed = turn(addr, metrics_url, prompt[mode], args.answer)
                    rows.append({"conversation": c, "turn": t + 1, "mode": mode, "prompt_tokens": len(prompt[mode]),
                                 "ttft_s": ttft, "computed_prefill": computed["prefill"],
                                 "computed_decode": computed["decode"]})
                    print(json.dumps(rows[-1]), flush=True)
                    prompt[mode] += answer
                if prompt["on"] != prompt["off"]:
                    print(f"!! conversation {c} turn {t + 1}: the clusters' greedy answers differ", flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    print("\nturn  prompt  TTFT on / off (median s)  ratio  tokens computed on (P + D) / off (P + D)")
    for t in range(1, args.turns + 1):
        def med(mode: str, key: str) -> float:
            return statistics.median(r[key] for r in rows if r["turn"] == t and r["mode"] == mode)
        on, off = med("on", "ttft_s"), med("off", "ttft_s")
        print(f"{t:>4}  {med('on', 'prompt_tokens'):>6.0f}  {on:.3f} / {off:.3f}  {on / off:5.2f}  "
              f"{med('on', 'computed_prefill'):.0f} + {med('on', 'computed_decode'):.0f} / "
              f"{med('off', 'computed_prefill'):.0f} + {med('off', 'computed_decode'):.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
