"""`pdserve plan`: profile this machine's tiers, simulate a cluster, size the cheapest plans, validate.

    pdserve plan profile  [--out profile.json]        measure the tiers through the served engines
    pdserve plan simulate --profile P [bench's flags] one cluster on one workload (--json: bench's keys)
    pdserve plan size     --profile P [bench's flags] cheapest plans meeting SLOs; a kustomize overlay
    pdserve plan validate --profile P                 the simulator against `pdserve bench` on a real 1P+1D
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {"profile": "measure", "simulate": "simulate_cli", "size": "size", "validate": "validate"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__.strip(), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"pdserve plan: unknown command {argv[0]!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
            return 2
        return 0 if argv else 2
    module = importlib.import_module(f"pdserve.benchmarks.plan.{COMMANDS[argv[0]]}")
    try:
        return module.main(argv[1:])
    except ValueError as e:
        print(f"pdserve plan {argv[0]}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
