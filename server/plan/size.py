"""`pdserve plan size`: the cheapest plans that meet the SLOs, per hardware pairing, and an overlay.

    pdserve plan size --model-shape llama-3.1-8b --input-len 2048 --output-len 256 --request-rate 50 \
        --duration 30 --slo-ttft-ms 1000 --slo-tpot-ms 50 --attainment 0.9 [--json] [--overlay DIR]

Pairings: TPU prefill + GPU decode, GPU + GPU (the same GPU both tiers), colocated GPU, colocated TPU,
over the catalog's accelerators with a price (--price 'NAME=USD' adds or changes one). Dtypes: weights
bf16 with a bf16 KV cache, or fp8 (fp4 where both chips have it) with an fp8 cache (what crosses
the wire), the same on both tiers.
Each tier's profile is projected from the catalog by roofline.py (efficiency factors from --profile when
it was measured on an accelerator, the decode tier's from the profile's row at the plan's dtypes where it
measured them, else roofline.DEFAULT). For each pairing and dtypes, the pool sizes
start at what the tiers' throughput needs (`lower_bound`) and grow the tier the SLO misses point at
(TTFT: prefill; TPOT: decode; colocated: both at once; to what would run it at TARGET_UTILISATION) until a simulated run meets the attainment or
--max-workers is reached. A plan meets the SLOs when at least --attainment of its requests meet both
TTFT <= --slo-ttft-ms and TPOT <= --slo-tpot-ms (bench's goodput rule) and, given --slo-itl-ms, the
pooled ITL p99 is within it. $/Mtok is the plan's $/hour over the tokens (prompt + output) it serves per
hour; goodput per chip is the requests/s meeting the SLOs over its chips.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.server.plan import catalog as catalog_mod
from pdserve.server.plan.catalog import Accelerator, Catalog, Dtype, ModelShape
from pdserve.server.plan.cluster import simulate
from pdserve.server.plan.profile import HandoffCost, Profile
from pdserve.server.plan.roofline import DEFAULT, DoesNotFit, Efficiency, efficiency_of, project
from pdserve.server.plan.workload import SimRequest


TARGET_UTILISATION = 0.8
"""A tier that misses its SLO grows to the workers that would run it at this utilisation (at least +1)."""


@dataclass(frozen=True)
class Slo:
    ttft_ms: float
    tpot_ms: float
    attainment: float = 0.9
    itl_p99_ms: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--slo-{name.replace('_ms', '')}-ms must be > 0, got {getattr(self, name)}")
        if self.itl_p99_ms is not None and not self.itl_p99_ms > 0:
            raise ValueError(f"--slo-itl-ms must be > 0, got {self.itl_p99_ms}")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"--attainment must be in (0, 1], got {self.attainment}")


@dataclass(frozen=True)
class Pairing:
    kind: str
    """tpu+gpu, gpu+gpu, colocated-gpu, colocated-tpu."""
    prefill: Accelerator | None
    decode: Accelerator


@dataclass
class Plan:
    pairing: str
    prefill_hw: str | None
    decode_hw: str
    prefill_weights: str | None
    decode_weights: str
    kv_dtype: str
    prefill_workers: int
    decode_workers: int
    chips_per_prefill: int
    chips_per_decode: int
    dollars_per_hour: float
    dollars_per_mtok: float
    goodput: float
    goodput_per_chip: float
    attainment: float
    ttft_p99_ms: float
    tpot_p99_ms: float
    itl_p99_ms: float
    kv_usage: float
    prefill_utilisation: float
    decode_utilisation: float
    meets: bool

    @property
    def chips(self) -> int:
        return self.prefill_workers * self.chips_per_prefill + self.decode_workers * self.chips_per_decode

    @property
    def ratio(self) -> str:
        return "colocated" if not self.prefill_workers else f"{self.prefill_workers}:{self.decode_workers}"


def pairings(cat: Catalog, names: list[str] | None) -> list[Pairing]:
    accs = [a for a in cat.accelerators.values() if a.price_per_hour is not None and (not names or a.name in names)]
    gpus, tpus = [a for a in accs if a.kind == "gpu"], [a for a in accs if a.kind == "tpu"]
    out = [Pairing("tpu+gpu", t, g) for t in tpus for g in gpus]
    out += [Pairing("gpu+gpu", g, g) for g in gpus]
    out += [Pairing("colocated-gpu", None, g) for g in gpus] + [Pairing("colocated-tpu", None, t) for t in tpus]
    return out


def dtype_choices(p: Pairing) -> list[tuple[Dtype, Dtype, Dtype]]:
    """(prefill weights, decode weights, KV): bf16 with a bf16 cache, fp8 (fp4 where both tiers' chips have it)
    with an fp8 cache: the same weight dtype on both tiers, to bound the search."""
    chips = [a for a in (p.prefill, p.decode) if a is not None]
    weights: list[Dtype] = ["bf16", "fp8"] + (["fp4"] if all(a.flops("fp4") for a in chips) else [])
    return [(w, w, "bf16" if w == "bf16" else "fp8") for w in weights]


def lower_bound(prefill: Profile, decode: Profile, requests: list[SimRequest], duration: float,
                colocated: bool) -> tuple[int, int]:
    """Workers each tier needs to keep up at all: prefill tokens/s at full 8192-token steps, decode
    tokens/s at the batch the KV cache holds (at most 64 sequences)."""
    prompt = sum(r.prompt_len for r in requests) / duration
    outputs = sum(r.output_len for r in requests) / duration
    mean_ctx = sum(r.prompt_len + r.output_len / 2 for r in requests) / len(requests)
    step = 8192
    prefill_rate = step / prefill.prefill.step_seconds(step, 0)
    batch = max(1, min(64, int(decode.kv_cache_tokens / mean_ctx)))
    decode_rate = batch / decode.decode.step_seconds(batch, int(batch * mean_ctx))
    if colocated:
        share = prompt / prefill_rate + outputs / decode_rate
        return 0, max(1, math.ceil(share))
    return max(1, math.ceil(prompt / prefill_rate)), max(1, math.ceil(outputs / decode_rate))


def verdict(s: dict, slo: Slo) -> str:
    """"" when the summary meets the SLOs, else which tier to grow: "prefill", "decode" or "both"."""
    itl_bad = slo.itl_p99_ms is not None and s["itl_ms"].get("p99", 0.0) > slo.itl_p99_ms
    if s["slo_attainment"] >= slo.attainment and not itl_bad:
        return ""
    ttft_bad = s["failed"] > 0 or s["ttft_ms"].get("p90", math.inf) > slo.ttft_ms
    tpot_bad = itl_bad or s["tpot_ms"].get("p90", math.inf) > slo.tpot_ms
    return "prefill" if ttft_bad and not tpot_bad else "decode" if tpot_bad and not ttft_bad else "both"


@dataclass(frozen=True)
class Search:
    requests: list[SimRequest]
    duration: float
    slo: Slo
    model: ModelShape
    efficiency: Efficiency
    spec_for: object
    """(prefill workers, decode workers, colocated) -> ClusterSpec."""
    max_workers: int = 64
    max_steps: int = 12
    by_dtype: dict[str, Efficiency] | None = None
    """The decode tier's factors per catalog "WEIGHTS/KV" dtypes where the profile measured that pair
    (`efficiencies`); `efficiency` elsewhere."""

    def efficiency_at(self, weights: Dtype, kv: Dtype) -> Efficiency:
        return (self.by_dtype or {}).get(f"{weights}/{kv}", self.efficiency)


def plan_for(search: Search, pairing: Pairing, dtypes: tuple[Dtype, Dtype, Dtype]) -> Plan | None:
    """The smallest pools (module docstring) for one pairing and dtypes; None when the model does not fit."""
    pw, dw, kv = dtypes
    try:
        d_prof = project(pairing.decode, search.model, dw, kv, search.efficiency_at(dw, kv))
        p_prof = project(pairing.prefill, search.model, pw, kv, search.efficiency) if pairing.prefill else None
    except DoesNotFit:
        return None
    colocated = p_prof is None
    link = min(d_prof.handoff.bytes_per_s, p_prof.handoff.bytes_per_s if p_prof else math.inf)
    handoff = HandoffCost(d_prof.handoff.fixed_s, link, d_prof.handoff.kv_bytes_per_token)
    n_p, n_d = lower_bound(p_prof or d_prof, d_prof, search.requests, search.duration, colocated)
    summary, why = None, "both"
    for _ in range(search.max_steps):
        if n_p + n_d > search.max_workers:
            break
        spec = search.spec_for(n_p, n_d, colocated)
        result = simulate(search.requests, spec, p_prof or d_prof, d_prof, handoff)
        summary = result.summary(search.slo.ttft_ms, search.slo.tpot_ms)
        why = verdict(summary, search.slo)
        if not why:
            break
        util = summary["sim"]["utilisation"]
        busy = lambda role: max(v for k, v in util.items() if k.startswith(role))  # noqa: E731
        grow = lambda n, u: max(n + 1, math.ceil(n * u / TARGET_UTILISATION))  # noqa: E731
        if colocated:
            n_d = grow(n_d, busy("colocated"))
        else:
            n_p = grow(n_p, busy("prefill")) if why in ("prefill", "both") else n_p
            n_d = grow(n_d, busy("decode")) if why in ("decode", "both") else n_d
    if summary is None:
        return None
    price_p = pairing.prefill.price_per_hour if pairing.prefill else 0.0
    hourly = n_p * (p_prof.chips if p_prof else 0) * price_p + n_d * d_prof.chips * pairing.decode.price_per_hour
    tokens_per_s = summary["total_token_throughput"]
    chips = n_p * (p_prof.chips if p_prof else 0) + n_d * d_prof.chips
    util = summary["sim"]["utilisation"]
    mean = lambda role: (sum(v for k, v in util.items() if k.startswith(role)) /  # noqa: E731
                         max(1, sum(1 for k in util if k.startswith(role))))
    return Plan(
        pairing=pairing.kind, prefill_hw=pairing.prefill.name if pairing.prefill else None,
        decode_hw=pairing.decode.name, prefill_weights=pw if p_prof else None, decode_weights=dw, kv_dtype=kv,
        prefill_workers=n_p, decode_workers=n_d, chips_per_prefill=p_prof.chips if p_prof else 0,
        chips_per_decode=d_prof.chips, dollars_per_hour=hourly,
        dollars_per_mtok=hourly / (3600 * tokens_per_s / 1e6) if tokens_per_s else math.inf,
        goodput=summary["goodput"], goodput_per_chip=summary["goodput"] / chips, attainment=summary["slo_attainment"],
        ttft_p99_ms=summary["ttft_ms"].get("p99", math.nan), tpot_p99_ms=summary["tpot_ms"].get("p99", math.nan),
        itl_p99_ms=summary["itl_ms"].get("p99", math.nan), kv_usage=summary["sim"]["kv_usage_mean"],
        prefill_utilisation=mean("prefill"), decode_utilisation=mean("colocated" if colocated else "decode"),
        meets=not why)


def format_plans(plans: list[Plan]) -> str:
    lines = [f"{'pairing':<14} {'prefill':<18} {'decode':<18} {'KV':<5} {'P:D':>9} {'chips':>5} {'$/h':>8} "
             f"{'$/Mtok':>8} {'goodput/chip':>12} {'attain':>6} {'TTFT p99':>9} {'TPOT p99':>9}  meets"]
    for p in plans:
        pre = f"{p.prefill_workers}x{p.chips_per_prefill} {p.prefill_hw} {p.prefill_weights}" if p.prefill_hw else "-"
        dec = f"{p.decode_workers}x{p.chips_per_decode} {p.decode_hw} {p.decode_weights}"
        lines.append(f"{p.pairing:<14} {pre:<18} {dec:<18} {p.kv_dtype:<5} {p.ratio:>9} {p.chips:>5} "
                     f"{p.dollars_per_hour:>8.2f} {p.dollars_per_mtok:>8.3f} {p.goodput_per_chip:>12.3f} "
                     f"{p.attainment:>6.2f} {p.ttft_p99_ms:>9.0f} {p.tpot_p99_ms:>9.1f}  {'yes' if p.meets else 'NO'}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    from pdserve.server.plan.bench_flags import add_bench_flags
    from pdserve.server.plan.simulate_cli import add_cluster_flags

    p = argparse.ArgumentParser(prog="pdserve plan size", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_flags(p)
    p.set_defaults(request_rate=None, duration=None)
    s = p.add_argument_group("sizing")
    s.add_argument("--model-shape", default="llama-3.1-8b", help="a model of the catalog's `models`")
    s.add_argument("--catalog", type=Path, help="a catalog file (default: the shipped catalog.json)")
    s.add_argument("--hardware", action="append", help="only these accelerators (repeat)")
    s.add_argument("--price", action="append", default=[], help="NAME=USD per chip-hour (repeat)")
    s.add_argument("--profile", type=Path, help="a measured profile whose efficiency factors to use")
    s.add_argument("--attainment", type=float, default=0.9)
    s.add_argument("--slo-itl-ms", type=float, default=None, help="pooled ITL p99 bound")
    s.add_argument("--max-workers", type=int, default=64)
    s.add_argument("--top", type=int, default=1, help="plans shown per pairing (cheapest first)")
    s.add_argument("--trace", type=Path, help="a trace file instead of the distributions")
    s.add_argument("--json", action="store_true")
    s.add_argument("--overlay", type=Path, help="write a kustomize overlay for the cheapest plan meeting the SLOs")
    s.add_argument("--overlay-pairing", choices=["tpu+gpu", "gpu+gpu", "colocated-gpu", "colocated-tpu"],
                   help="the overlay's plan: the cheapest of this pairing instead")
    s.add_argument("--plans", type=Path, help="the plans of an earlier `--json` run instead of a search")
    add_cluster_flags(p)
    return p


def _catalog(args) -> Catalog:
    cat = catalog_mod.load(args.catalog)
    accs = dict(cat.accelerators)
    for item in args.price:
        name, sep, value = item.partition("=")
        if not sep or name not in accs:
            raise ValueError(f"--price {item!r}: give NAME=USD with a catalog name ({', '.join(accs)})")
        try:
            price = float(value)
        except ValueError:
            price = -1.0
        if not price > 0:
            raise ValueError(f"--price {item!r}: the price must be a number > 0")
        accs[name] = Accelerator(**{**asdict(accs[name]), "price_per_hour": price})
    return Catalog(cat.date, accs, cat.models)


SERVED_DTYPES = {"bf16": ("bfloat16", "auto"), "fp8": ("fp8", "fp8_e4m3"), "fp4": ()}
"""The catalog's dtypes as the decode worker's --weight-dtype/--kv-dtype name them (auto: a bf16 checkpoint's)."""


def efficiencies(measured: Profile) -> dict[str, Efficiency]:
    """{catalog "WEIGHTS/KV": the factors of the profile's decode row measured at that pair} (the prefill's
    from the main row): a measured fp8 decode step sets the fp8 plans' decode factors."""
    out = {}
    for weights, served_w in SERVED_DTYPES.items():
        for kv, served_kv in SERVED_DTYPES.items():
            for pair in measured.measured_dtypes:
                w, k = pair.split("/")
                if w in served_w and k in served_kv and f"{weights}/{kv}" not in out:
                    eff = efficiency_of(measured.with_dtypes(w, k))
                    if eff is not None:
                        out[f"{weights}/{kv}"] = eff
    return out


def _efficiency(args) -> Efficiency:
    if args.profile is None:
        print("efficiency: roofline.DEFAULT (0.5 of peak FLOP/s, 0.7 of HBM bandwidth); --profile gives measured "
              "factors", file=sys.stderr)
        return DEFAULT
    measured = Profile.load(args.profile)
    eff = efficiency_of(measured)
    if eff is None or measured.notes.get("kind", "cpu") == "cpu":
        got = f" ({eff.compute:.2g} of FLOP/s, {eff.bandwidth:.2g} of bandwidth)" if eff else ""
        print(f"efficiency: roofline.DEFAULT: {args.profile} was measured on a CPU{got}, whose factors measure "
              f"per-step overhead, not an accelerator's roofline (benchmarks/README.md, `pdserve plan`)",
              file=sys.stderr)
        return DEFAULT
    return eff


def run(args) -> tuple[list[Plan], Search]:
    from pdserve.server.plan.simulate_cli import cluster_spec, workload

    slo = Slo(args.slo_ttft_ms or 0.0, args.slo_tpot_ms or 0.0, args.attainment, args.slo_itl_ms)
    if args.request_rate is None and not args.trace:
        raise ValueError("give --request-rate (requests/s) or --trace")
    if args.duration is None and not args.num_prompts and not args.trace:
        args.duration = 30.0
    cat = _catalog(args)
    model = cat.model(args.model_shape)
    requests = workload(args)
    duration = max(r.arrival for r in requests) or 1.0
    max_len = max(r.prompt_len + r.output_len for r in requests)
    eff = _efficiency(args)
    by_dtype = efficiencies(Profile.load(args.profile)) if args.profile and eff is not DEFAULT else None
    if by_dtype:
        print(f"efficiency: the decode tier's per dtype pair measured ({', '.join(by_dtype)})", file=sys.stderr)
    search = Search(requests, duration, slo, model, eff,
                    lambda n_p, n_d, colo: cluster_spec(args, max_len, colocated=colo, prefill_workers=n_p,
                                                        decode_workers=n_d), args.max_workers, by_dtype=by_dtype)
    found = pairings(cat, args.hardware)
    if not found:
        raise ValueError("no accelerator with a price to plan on: add --price NAME=USD or drop --hardware")
    plans: list[Plan] = []
    from tqdm import tqdm

    jobs = [(pair, d) for pair in found for d in dtype_choices(pair)]
    for pair, dtypes in tqdm(jobs, desc="plan size", unit="config", file=sys.stderr):
        plan = plan_for(search, pair, dtypes)
        if plan is not None:
            plans.append(plan)
    return plans, search


def best_per_pairing(plans: list[Plan], top: int) -> list[Plan]:
    out = []
    for kind in dict.fromkeys(p.pairing for p in plans):
        group = sorted((p for p in plans if p.pairing == kind), key=lambda p: (not p.meets, p.dollars_per_mtok))
        out += group[:top]
    return sorted(out, key=lambda p: (not p.meets, p.dollars_per_mtok))


def load_plans(path: Path) -> list[Plan]:
    try:
        rows = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the plans {path}: {e}; write them with `pdserve plan size ... --json > FILE`") from None
    names = set(Plan.__dataclass_fields__)
    return [Plan(**{k: v for k, v in row.items() if k in names}) for row in rows]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.plans:
        shown = load_plans(args.plans)
        slo = Slo(args.slo_ttft_ms or 0.0, args.slo_tpot_ms or 0.0, args.attainment, args.slo_itl_ms)
    else:
        plans, search = run(args)
        shown = best_per_pairing(plans, args.top)
        slo = search.slo
    if args.json:
        print(json.dumps([{**asdict(p), "chips": p.chips, "ratio": p.ratio} for p in shown], indent=2))
    else:
        print(format_plans(shown))
    meeting = [p for p in shown if p.meets and (args.overlay_pairing in (None, p.pairing))]
    if args.overlay:
        if not meeting:
            raise ValueError("no plan meets the SLOs: no overlay written; raise --max-workers or relax the SLOs")
        from pdserve.server.plan.overlay import write_overlay

        write_overlay(args.overlay, meeting[0], slo)
        print(f"overlay for the cheapest plan: {args.overlay} (kubectl kustomize {args.overlay})", file=sys.stderr)
    return 0 if meeting else 1


if __name__ == "__main__":
    sys.exit(main())
