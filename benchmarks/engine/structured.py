"""Structured output's cost on the decode tier: ITL of 16 streams held to a nested JSON schema against 16 free
streams, in one run, phases alternating (protocol.py `schedule`); and a grammar's compile time, cold and cached.

The model is Qwen2.5-0.5B's shape with random weights and its 151,936-token vocabulary (checkpoint.py), so each
mask is as wide as a real model's; `--layers` shortens it (a shorter step makes the mask's share larger).
Streams sample at temperature 1 (ignore_eos for the free ones); the schema's array needs more items than the
token budget holds, so no constrained stream ends early and both phases run the same steps. Each stream's
prompt is prefilled on the decode engine itself (local prefill) before its phase is timed: ITL is the gap
between a stream's consecutive tokens, every stream of the phase pooled.

    python -m pdserve.benchmarks.engine.structured --out results/structured [--layers 24] [--tokens 32] [--reps 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "users": {
            "type": "array", "minItems": 1000,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 12},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "tags": {"type": "array", "items": {"enum": ["admin", "dev", "ops"]}, "maxItems": 3},
                    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                                "required": ["city", "zip"], "additionalProperties": False},
                },
                "required": ["name", "age", "tags", "address"], "additionalProperties": False,
            },
        },
    },
    "required": ["users"], "additionalProperties": False,
}
"""Nested: objects in an array in an object, with bounds, an enum and a pattern."""
STREAMS = 16


def compile_times(model_dir: Path, vocab_size: int, eos: tuple[int, ...]) -> dict[str, float]:
    """Seconds: the LLTokenizer (once per worker), the schema's check in a grammar child (the child's start and
    LLTokenizer included), its first compile here, a cached one, a sequence's copy."""
    from pdserve.v1 import generation_pb2 as gen_pb
    from pdserve.server.structured.grammars import Grammars

    spec = gen_pb.StructuredOutput(json_schema=json.dumps(SCHEMA))
    grammars = Grammars.for_model(model_dir, vocab_size, eos)
    t0 = time.perf_counter()
    grammars.tokenizer
    checked = time.perf_counter()
    grammars.checker.check_sync(spec)
    t1 = time.perf_counter()
    grammars.compiled(spec)
    t2 = time.perf_counter()
    grammars.compiled(spec)
    t3 = time.perf_counter()
    grammars.constraint(spec)
    t4 = time.perf_counter()
    return {"tokenizer_s": checked - t0, "check_s": t1 - checked, "compile_cold_s": t2 - t1, "compile_cached_s": t3 - t2, "constraint_s": t4 - t3}


def mask_cost(grammars, vocab_size: int, steps: int = 20) -> dict[str, float]:
    """Milliseconds per decode step for STREAMS constrained rows, alone (no model, so no machine noise from
    the forward pass): the host filling their masks, and the batch's masked fill on the logits."""
    import numpy as np
    import torch

    from pdserve.v1 import generation_pb2 as gen_pb
    from pdserve.server.decode.sampler import apply_bitmask
    from pdserve.server.structured.bitmask import allowed_ids, unconstrained

    spec = gen_pb.StructuredOutput(json_schema=json.dumps(SCHEMA))
    rows = [grammars.constraint(spec) for _ in range(STREAMS)]
    rng = np.random.default_rng(0)
    logits = torch.randn(STREAMS, vocab_size)
    fill_s = apply_s = 0.0
    for _ in range(steps):
        masks = unconstrained(STREAMS, vocab_size)
        t0 = time.perf_counter()
        for row, c in zip(masks, rows):
            c.fill(row)
        t1 = time.perf_counter()
        apply_bitmask(logits, torch.from_numpy(masks))
        t2 = time.perf_counter()
        fill_s, apply_s = fill_s + t1 - t0, apply_s + t2 - t1
        for row, c in zip(masks, rows):  # a random allowed token: the next step's state
            c.advance(int(rng.choice(allowed_ids(row, vocab_size))))
    return {"fill_ms": fill_s / steps * 1000, "apply_ms": apply_s / steps * 1000}


async def phase(engine, constrained: bool, tokens: int, rep: int) -> list[float]:
    """Every inter-token gap (seconds) of STREAMS streams decoding together."""
    from pdserve.v1 import generation_pb2 as gen_pb
    from pdserve.v1 import worker_pb2 as pb

    spec = gen_pb.StructuredOutput(json_schema=json.dumps(SCHEMA)) if constrained else None
    seqs = []
    for i in range(STREAMS):
        sampling = gen_pb.SamplingParams(max_tokens=tokens, temperature=1.0, top_p=1.0, seed=1000 * rep + i,
                                         ignore_eos=not constrained)
        if spec is not None:
            sampling.structured.CopyFrom(spec)
        seq = engine.add(pb.DecodeRequest(request_id=f"{'c' if constrained else 'f'}{rep}-{i}",
                                          prompt_token_ids=[(7 * i + k) % (engine.vocab_size - 8) + 4 for k in range(24)],
                                          sampling=sampling, local_prefill=True))
        await seq.admitted
        seqs.append((seq, await engine.prefill_locally(seq)))
    gaps: list[float] = []

    async def drain(seq) -> None:
        last = None
        while (ids := await seq.events.get()) is not None:
            now = time.perf_counter()
            if last is not None:
                gaps.append((now - last) / len(ids))
            last = now

    for seq, first in seqs:  # all join before the first step
        engine.start(seq, first)
    await asyncio.gather(*(drain(s) for s, _ in seqs))
    assert all(len(s.output_ids) == tokens for s, _ in seqs), [len(s.output_ids) for s, _ in seqs]
    return gaps


async def run(args) -> dict:
    import torch

    from pdserve.benchmarks.checkpoint import make_qwen25_05b_shape
    from pdserve.benchmarks.protocol import LoadMonitor, MachineRecord, gate, schedule, spread
    from pdserve.kvcache.layout import KvLayout
    from pdserve.server.decode.engine import DecodeEngine
    from pdserve.server.decode.weights import build_model
    from pdserve.server.model.config import load_config
    from pdserve.server.model.weights import load_weights
    from pdserve.server.structured.grammars import Grammars

    record = MachineRecord.take()
    gate(record, args.max_load, args.allow_noisy)
    model_dir = make_qwen25_05b_shape(args.checkpoint / f"qwen25-05b-{args.layers}l", "float32",
                                      num_hidden_layers=args.layers)
    config = load_config(model_dir)
    eos = tuple(config.eos_token_ids)
    compiles = compile_times(model_dir, config.vocab_size, eos)
    masks = mask_cost(Grammars.for_model(model_dir, config.vocab_size, eos), config.vocab_size)
    torch.set_num_threads(args.threads)
    model = build_model(config, load_weights(model_dir))
    layout = KvLayout(config.num_layers, config.num_kv_heads, config.head_dim, block_size=16, dtype="float32")
    engine = DecodeEngine(model, layout, num_blocks=STREAMS * 8, max_running=STREAMS, eos_ids=frozenset(eos),
                          max_model_len=128, grammars=Grammars.for_model(model_dir, config.vocab_size, eos))
    await phase(engine, True, 4, 98)  # warm: the grammar compiled, the step's kernels run once
    await phase(engine, False, 4, 99)
    itl: dict[str, list[float]] = {"free": [], "constrained": []}
    with LoadMonitor() as monitor:
        for rep, system in schedule(["free", "constrained"], args.reps):
            gaps = await phase(engine, system == "constrained", args.tokens, rep)
            itl[system].append(statistics.mean(gaps) * 1000)
    await engine.close()
    record.finish(monitor)
    ratio = [c / f for c, f in zip(itl["constrained"], itl["free"])]
    return {"machine": record.as_dict(), "layers": args.layers, "tokens": args.tokens, "streams": STREAMS,
            "compile": compiles, "mask_ms_per_step": masks, "itl_ms": {k: spread(v) for k, v in itl.items()}, "itl_ms_reps": itl,
            "overhead": spread([r - 1 for r in ratio]), "markdown_machine": record.markdown()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("results/structured"))
    p.add_argument("--checkpoint", type=Path, default=Path("/tmp/pdserve-bench"))
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--tokens", type=int, default=32, help="tokens per stream per phase")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-load", type=float, default=1.5)
    p.add_argument("--allow-noisy", action="store_true")
    args = p.parse_args()
    result = asyncio.run(run(args))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "structured.json").write_text(json.dumps(result, indent=2))
    c, itl, o = result["compile"], result["itl_ms"], result["overhead"]
    print(result["markdown_machine"])
    print(f"grammar: tokenizer {c['tokenizer_s'] * 1000:.0f} ms (once per worker), check in a grammar child "
          f"{c['check_s'] * 1000:.0f} ms (its start included), compile cold "
          f"{c['compile_cold_s'] * 1000:.1f} ms, cached {c['compile_cached_s'] * 1e6:.0f} us, a sequence's copy "
          f"{c['constraint_s'] * 1e6:.0f} us")
    m = result["mask_ms_per_step"]
    print(f"masks per step for {STREAMS} constrained rows: host fill {m['fill_ms']:.2f} ms, masked fill "
          f"{m['apply_ms']:.2f} ms")
    print(f"ITL ms (mean over a phase's gaps; median [min-max] of {args.reps} reps): free "
          f"{itl['free']['median']:.1f} [{itl['free']['min']:.1f}-{itl['free']['max']:.1f}], constrained "
          f"{itl['constrained']['median']:.1f} [{itl['constrained']['min']:.1f}-{itl['constrained']['max']:.1f}]; "
          f"overhead {o['median'] * 100:+.1f}% [{o['min'] * 100:+.1f}%, {o['max'] * 100:+.1f}%]")


if __name__ == "__main__":
    main()
