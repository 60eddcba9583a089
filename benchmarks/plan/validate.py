"""`pdserve plan validate`: the simulator's prediction against `pdserve bench` on a real 1P+1D cluster.

    pdserve plan validate --profile benchmarks/plan/profile-cpu.json [--measure] [--readme benchmarks/README.md]

For two workload shapes (short and long prompts) it finds the rate where the simulated cluster saturates
(`saturation`: where the late requests' simulated TTFT passes 4x the idle one), and runs three rates: 0.3x, 0.7x and 1.4x that (the last past saturation).
Each (shape, rate) is sent by `pdserve bench` (Poisson arrivals; the i-th run seeded --seed + i, so no run
sends an earlier run's prompts, which the cluster's prefix caches would serve) to a 1 prefill + 1 decode
cluster started by `pdserve up`'s launcher, and simulated with the same flags and the profile; the table
puts the predicted TTFT p50/p99 and TPOT p50 beside the measured ones with the relative error.
`--measure` first writes the profile (`pdserve plan profile`) from the same cluster's machine.
The simulated cluster shares the host's cores as the real one does (`--host-cores`, default this machine's;
contention.py): the coordinator's and the load client's CPU per request and token from the profile, and
the cores the rest of the host kept busy during each run (procstat.py, /proc/stat), measured per run.
`--readme` replaces the table between the markers `<!-- plan-validation -->` ... `<!-- /plan-validation -->`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from pdserve.benchmarks.plan import pinning
from pdserve.benchmarks.plan.measure import PREFILL_ARGS
from pdserve.benchmarks.plan.procstat import Window
from pdserve.server.plan.profile import Profile

SHAPES = {"short": (64, 32), "long": (384, 32)}
RATE_FACTORS = (0.3, 0.7, 1.4)
TOLERANCE = 0.25
MARK, END = "<!-- plan-validation -->", "<!-- /plan-validation -->"
_START = time.perf_counter()


def log(message: str) -> None:
    print(f"[plan validate {time.perf_counter() - _START:6.1f}s] {message}", file=sys.stderr, flush=True)


def workload_argv(input_len: int, output_len: int, rate: float, duration: float, seed: int) -> list[str]:
    return ["--input-len", str(input_len), "--output-len", str(output_len), "--request-rate", f"{rate:.3f}",
            "--duration", str(duration), "--seed", str(seed), "--vocab-size", "500"]


def host_argv(cores: float, external: float = 0.0, placement: dict[str, int] | None = None) -> list[str]:
    """simulate's flags for a host of `cores` shared by the cluster, `external` of them busy with others,
    each process pinned as `placement` says (None: they float)."""
    if not cores:
        return []
    return ["--host-cores", f"{cores:g}", "--external-cores", f"{external:.3f}", *pinning.placement_argv(placement)]


def predict(profile_path: Path, argv: list[str], max_model_len: int) -> dict:
    from pdserve.server.plan import simulate_cli

    args = simulate_cli.build_parser().parse_args(
        ["--profile", str(profile_path), "--max-model-len", str(max_model_len), *argv])
    return simulate_cli.run(args)


def _late_ttft(profile_path: Path, argv: list[str], max_model_len: int) -> float:
    """The mean simulated TTFT (s) of the last quarter of the requests: it grows with the run once the
    cluster falls behind."""
    from pdserve.server.plan import simulate_cli
    from pdserve.server.plan.cluster import simulate

    args = simulate_cli.build_parser().parse_args(
        ["--profile", str(profile_path), "--max-model-len", str(max_model_len), *argv])
    requests = simulate_cli.workload(args)
    profile = Profile.load(profile_path)
    host = simulate_cli.host_of(args, profile.host_cpu)
    result = simulate(requests, simulate_cli.cluster_spec(args, max_model_len, host=host), profile)
    late = [o.ttft if o.success else args.timeout or 600.0 for o in result.outputs[-max(len(result.outputs) // 4, 1):]]
    return sum(late) / len(late)


def saturation(profile_path: Path, shape: tuple[int, int], duration: float, seed: int, max_model_len: int,
               host: list[str] = ()) -> float:
    """The offered rate at which the simulated 1P+1D cluster stops keeping up: the late requests' TTFT
    passes 4x the idle one (doubling the rate from 0.5 req/s, then 3 halvings of the interval)."""
    def saturated(rate: float) -> bool:
        argv = [*workload_argv(*shape, rate, 2 * duration, seed), *host]
        return _late_ttft(profile_path, argv, max_model_len) > 4 * idle

    idle = _late_ttft(profile_path, [*workload_argv(*shape, 0.1, 2 * duration, seed), *host], max_model_len)
    lo, hi = 0.25, 0.5
    while not saturated(hi):
        lo, hi = hi, hi * 2
        if hi > 10_000:
            raise RuntimeError("the simulated cluster never saturates: is the profile's step time 0?")
    for _ in range(3):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if saturated(mid) else (mid, hi)
    return hi


def measure(address: str, argv: list[str], out: Path) -> dict:
    from pdserve.benchmarks import bench

    args = bench.build_parser().parse_args(["--addr", address, "--timeout", "300", "--warmup", "4", "--no-plots",
                                            "--out", str(out), *argv])
    import asyncio

    return asyncio.run(bench._main(args))["summary"]


def _err(pred: float, meas: float) -> float:
    return (pred - meas) / meas if meas else float("inf")


def table(rows: list[dict]) -> str:
    lines = ["| shape | rate (req/s) | TTFT p50 pred / meas (ms) | err | TTFT p99 pred / meas (ms) | err | "
             "TPOT p50 pred / meas (ms) | err | completed pred / meas | cores used: coordinator / prefill / decode | "
             "other load (cores) | load avg |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        p, m = r["predicted"], r["measured"]
        cells = []
        for key, stat in (("ttft_ms", "median"), ("ttft_ms", "p99"), ("tpot_ms", "median")):
            pv, mv = p[key].get(stat, float("nan")), m[key].get(stat, float("nan"))
            e = _err(pv, mv)
            cells += [f"{pv:.1f} / {mv:.1f}", f"{100 * e:+.0f}%{'' if abs(e) <= TOLERANCE else ' ✗'}"]
        cores = r.get("cores", {})
        used = " / ".join(f"{cores.get(k, 0.0):.2f}" for k in ("coordinator", "prefill-0", "decode-0"))
        external = r.get("external_cores")
        lines.append(f"| {r['shape']} ({r['input_len']} in, {r['output_len']} out) | {r['rate']:.2f} | "
                     + " | ".join(cells) + f" | {p['completed']} / {m['completed']} | {used} | "
                     f"{'-' if external is None else f'{external:.2f}'} | {r.get('load_avg', float('nan')):.1f} |")
    within = sum(abs(_err(r["predicted"][k].get(s, 0), r["measured"][k].get(s, 0))) <= TOLERANCE
                 for r in rows for k, s in (("ttft_ms", "median"), ("ttft_ms", "p99"), ("tpot_ms", "median")))
    lines.append("")
    lines.append(f"{within} of {3 * len(rows)} figures within {TOLERANCE:.0%} (✗: outside).")
    return "\n".join(lines)


def write_readme(path: Path, text: str) -> None:
    doc = path.read_text()
    if MARK not in doc or END not in doc:
        raise ValueError(f"{path} has no {MARK} ... {END} markers to put the table between; add them")
    head, rest = doc.split(MARK, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{MARK}\n{text}\n{END}{tail}")


def _predict_again(args, profile: Profile, max_len: int) -> int:
    path = args.out / "validation.json"
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}; run `pdserve plan validate` first") from None
    for row in doc["rows"]:
        wl = workload_argv(row["input_len"], row["output_len"], row["rate"], args.duration, row.get("seed", args.seed))
        host = host_argv(row.get("host_cores", args.host_cores) if args.host_cores else 0.0,
                         row.get("external_cores", 0.0), row.get("placement"))
        predicted = predict(args.profile, [*wl, *host], max_len)
        row["predicted"] = {k: predicted[k] for k in ("ttft_ms", "tpot_ms", "itl_ms", "completed", "sim")}
    doc["profile"] = profile.to_json()
    path.write_text(json.dumps(doc, indent=2))
    text = table(doc["rows"])
    print(text)
    if args.readme:
        write_readme(args.readme, text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve plan validate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", type=Path, default=Path("benchmarks/plan/profile-cpu.json"))
    p.add_argument("--measure", action="store_true", help="write the profile first (`pdserve plan profile`)")
    p.add_argument("--model", type=Path, help="checkpoint (default: pdserve's embedded tiny model)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds bench sends each rate for")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/plan-validation"))
    p.add_argument("--readme", type=Path, help="put the table into this README between the markers")
    p.add_argument("--host-cores", type=float, default=float(os.cpu_count() or 1),
                   help="the cores the real cluster's processes share (default: this machine's); 0: simulate each "
                        "worker on cores of its own")
    p.add_argument("--pin", action="store_true",
                   help="each worker on a core of its own (the prefill worker, the coordinator and this client on the "
                        "first core, the decode worker on the second: pinning.py), the profile measured so too; on 2 "
                        "cores it predicts worse than floating (benchmarks/README.md)")
    p.add_argument("--predict-only", action="store_true",
                   help="no runs: predict the rows of --out's validation.json again with --profile (a changed fit)")
    return p


def main(argv: list[str] | None = None) -> int:
    from pdserve.server import launcher
    from pdserve.server.cli import default_model_dir
    from pdserve.server.model.config import load_config

    args = build_parser().parse_args(argv)
    model = args.model or default_model_dir()
    if args.measure:
        from pdserve.benchmarks.plan import measure as profile_cmd

        # the validation cluster's decode worker runs at auto/auto: the other pairs' rows are `plan profile`'s
        profile_cmd.main(["--out", str(args.profile), "--decode-dtypes", "auto/auto", *(["--pin"] if args.pin else []),
                          *(["--model", str(model)] if args.model else [])])
    profile = Profile.load(args.profile)
    max_len = load_config(model).max_model_len
    if args.predict_only:
        return _predict_again(args, profile, max_len)
    if args.host_cores < 0:
        raise ValueError(f"--host-cores must be >= 0, got {args.host_cores}")
    chosen = pinning.placement() if args.pin else None
    if chosen:
        pinning.pin_this_process(chosen)
    plan = []
    for name, shape in SHAPES.items():
        sat = saturation(args.profile, shape, args.duration, args.seed, max_len,
                         host_argv(args.host_cores, placement=chosen))
        log(f"{name} ({shape[0]} in, {shape[1]} out): the simulated cluster saturates near {sat:.2f} req/s")
        plan += [(name, shape, round(f * sat, 2)) for f in RATE_FACTORS]
    log(f"starting 1 prefill + 1 decode worker ({profile.hardware}); then {len(plan)} bench runs of "
        f"{args.duration:g} s each")
    cluster = launcher.launch(model, prefill_workers=1, decode_workers=1, port=0, host="127.0.0.1",
                              prefill_args=PREFILL_ARGS, cpus=pinning.launcher_cpus(chosen) if chosen else None)
    rows = []
    try:
        for i, (name, shape, rate) in enumerate(plan, 1):
            # each run its own prompts: the cluster's prefix caches keep the earlier runs' KV, and a run that
            # sent their prompts again would be served from it (the simulated cluster starts empty each run)
            wl = workload_argv(*shape, rate, args.duration, args.seed + i)
            log(f"[{i}/{len(plan)}] {name} at {rate} req/s: pdserve bench {' '.join(wl)}")
            window = Window({**cluster.describe()["pids"], "client": os.getpid()})
            measured = measure(cluster.coordinator.address, ["--no-progress", *wl], args.out / f"{name}-{rate}")
            host = window.end()
            predicted = predict(args.profile, [*wl, *host_argv(args.host_cores, host["external_cores"], chosen)], max_len)
            rows.append({"shape": name, "input_len": shape[0], "output_len": shape[1], "rate": rate,
                         "seed": args.seed + i,
                         "predicted": {k: predicted[k] for k in ("ttft_ms", "tpot_ms", "itl_ms", "completed", "sim")},
                         "measured": {k: measured[k] for k in ("ttft_ms", "tpot_ms", "itl_ms", "completed")},
                         "cores": host["cores"], "share": host["share"], "external_cores": host["external_cores"],
                         "host_cores": args.host_cores, "placement": chosen, "load_avg": os.getloadavg()[0]})
    finally:
        cluster.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "validation.json").write_text(json.dumps({"profile": profile.to_json(), "rows": rows}, indent=2))
    text = table(rows)
    print(text)
    if args.readme:
        write_readme(args.readme, text)
        print(f"table written into {args.readme}")
    print(f"rows: {args.out / 'validation.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
