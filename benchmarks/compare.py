"""Compares two benchmark runs' figures, refusing runs of different CPU families.

    python -m pdserve.benchmarks.compare BEFORE.json AFTER.json [--match side_by_side] [--across-families]

Each file is a run's JSON (side_by_side.json, prefill.json, decode_step.json, tiers' results): its
`machine` record (benchmarks/protocol.py) names the CPU family the figures were measured on. A figure
measured with AMX bf16 says nothing about an AVX2-only CPU, so runs whose families (or PDSERVE_CPU_ISA
caps) differ are refused (exit 2, naming both) unless --across-families, which marks every line. Each
numeric figure found at the same path in both runs (repetitions: their median) is printed with
AFTER / BEFORE.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from pdserve.benchmarks.protocol import comparable, family

SKIP = {"machine", "config", "order", "failures", "model"}
"""Top-level keys that hold no figures."""


def figures(doc, prefix: str = "") -> dict[str, float]:
    """path -> value of every numeric leaf (lists of dicts: the repetitions, merged by median)."""
    out: dict[str, list[float]] = {}

    def walk(node, path: str) -> None:
        if isinstance(node, bool):
            return
        if isinstance(node, (int, float)):
            out.setdefault(path, []).append(float(node))
        elif isinstance(node, dict):
            for key, value in node.items():
                if not (path == "" and key in SKIP):
                    walk(value, f"{path}/{key}" if path else str(key))
        elif isinstance(node, list):
            for value in node:
                walk(value, path)

    walk(doc, prefix)
    return {path: statistics.median(values) for path, values in out.items()}


def compare(before: dict, after: dict, match: str = "", across_families: bool = False) -> tuple[int, list[str]]:
    """(exit code, lines): 2 and the reason when the runs are not comparable."""
    why = comparable(before.get("machine", {}), after.get("machine", {}))
    if why and not across_families:
        return 2, [f"refusing to compare: {why}. Compare runs made on one CPU family, or pass --across-families "
                   f"to see the figures anyway (each line then says so)."]
    a, b = figures(before), figures(after)
    shared = [p for p in a if p in b and match in p]
    mark = f"  [across families: {family(before.get('machine', {}))} -> {family(after.get('machine', {}))}]" if why else ""
    lines = [f"{'figure':<60} {'before':>12} {'after':>12} {'after/before':>12}"]
    for path in shared:
        ratio = f"{b[path] / a[path]:.3f}" if a[path] else "-"
        lines.append(f"{path:<60} {a[path]:>12.4g} {b[path]:>12.4g} {ratio:>12}{mark}")
    if not shared:
        lines.append(f"(no figure{' matching ' + repr(match) if match else ''} is in both runs)")
    return 0, lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    p.add_argument("--match", default="", help="only figures whose path contains this (e.g. pdserve/decode-b4)")
    p.add_argument("--across-families", action="store_true",
                   help="compare runs of different CPU families anyway, marking every line")
    args = p.parse_args(argv)
    code, lines = compare(json.loads(args.before.read_text()), json.loads(args.after.read_text()), args.match,
                          args.across_families)
    print("\n".join(lines), file=sys.stderr if code else sys.stdout)
    return code


if __name__ == "__main__":
    sys.exit(main())
