"""Where the time goes: sampling profiles of pdserve's decode and prefill workers, one core each.

    .venv/bin/python -m pdserve.benchmarks.load.profile          # needs py-spy (in the dev extra) and ptrace rights

1. Makes (once) the Qwen2.5-0.5B-shaped random checkpoint and starts pdserve as the side-by-side does
   (`servers.start_pdserve`: prefill worker on core 0, decode worker with one thread on core 1).
2. Decode: `--decode-batch` requests decode together while py-spy samples the decode worker, and,
   separately, the coordinator (whose per-token work is gRPC and detokenising).
3. Prefill: prompts of each `--prefill-lens` run one at a time while py-spy samples the prefill worker.
4. Each sample is put in one category (`classify`): for torch, by the aten op that the Python code
   called (`at::_ops::<op>::call`, the outermost one in the stack); for XLA, by the thunk that runs
   (`DotThunk` = matmul, fused kernels, copies); otherwise by the Python module on the stack (gRPC and
   protobuf, asyncio, the tokenizer). What is left is Python itself (the engine's own code).
5. Writes <out>/profile.md and profile.json, and each profile's raw collapsed stacks (for a flame graph).

py-spy pauses the process for each sample (native stacks need it): on a worker pinned to one core this
can delay its replies enough for the coordinator's health checks to declare it dead (seen on the
prefill worker at 100 Hz); lower `--rate` if the coordinator log says so.

Shares are of the samples in which the process was running (py-spy leaves idle threads out), so
they say where the busy time goes, not how busy the worker was; per-core throughput against vLLM is
the side-by-side's `--per-core` probes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Self

from pdserve.benchmarks.bench import Group, run_groups, warmup
from pdserve.benchmarks.checkpoint import VOCAB_SIZE, make_qwen25_05b_shape
from pdserve.server.plan.datasets import synthetic
from pdserve.server.plan.arrivals import LoadSpec
from pdserve.benchmarks.paths import RESULTS
from pdserve.benchmarks.protocol import LoadMonitor, MachineRecord, gate
from pdserve.server.cache_dir import cache_dir


CATEGORIES = ("matmul", "attention", "kv gather/copy", "elementwise", "sampling", "XLA compute", "GIL wait",
              "gRPC/protobuf", "asyncio", "tokenizer", "python", "other native")
IDLE = "idle"  # a thread blocked in epoll, a queue or a condition: left out of the shares

# torch op (`at::_ops::<op>::call`, or its Python binding `THPVariable_<op>`) -> category; the first pattern that matches wins
_ATEN = [
    ((r"^(linear|addmm|mm|matmul|bmm|baddbmm|_linear_pointwise|mkldnn_.*linear.*|_weight_int8pack_mm|"
      r"_scaled_mm)$"), "matmul"),
    (r"^(scaled_dot_product_attention|_scaled_dot_product.*|_flash_attention.*|_softmax|softmax)$", "attention"),
    ((r"^(index_select|gather|index|index_put_?|_index_put_impl_|cat|copy_|clone|contiguous|_to_copy|to|"
      r"index_copy_?|scatter_?|narrow_copy|_unsafe_index|view_as_real|getitem|setitem|to_type)$"), "kv gather/copy"),
    (r"^(topk|sort|multinomial|argmax|argsort|cumsum|exponential_|log_softmax|_log_softmax|max)$", "sampling"),
]
# XLA CPU runtime: a thunk's class name -> category
_XLA = [
    (r"DotThunk|ConvolutionThunk|Eigen.*Contraction|EigenMatMul|dnnl|onednn|OneDnn|xnn_|Gemm|gemm|gemv|mkl_blas", "matmul"),
    (r"CopyThunk|memcpy|memmove|Transpose", "kv gather/copy"),
    (r"KernelThunk|SortThunk|ReduceThunk|LoopFusion|fusion", "elementwise"),
]
_PYTHON_MODULES = [
    (r"(^|/)grpc/|grpc/_cython|_pb2|google/protobuf|/pdserve/v1/", "gRPC/protobuf"),
    (r"(^|/)asyncio/|uvloop", "asyncio"),
    (r"tokenizers|detokenizer\.py", "tokenizer"),
    (r"sampler\.py", "sampling"),
]
_ATEN_OP = re.compile(r"at::_ops::([A-Za-z0-9_]+)::(call|redispatch)|THPVariable_([a-z][A-Za-z0-9_]*)")
_WAIT = re.compile(r"epoll_wait|epoll_pwait|pthread_cond_(timed)?wait|sem_wait|sem_timedwait|nanosleep|"
                   r"FutexWaiter|PerThreadSemWait|_queue_SimpleQueue_get|PyThread_acquire_lock|\bselect\b|\bpoll\b|"
                   r"futex_wait|__futex")
_GIL_TAKE = re.compile(r"gil_scoped_release::~gil_scoped_release|take_gil|PyEval_RestoreThread|PyEval_AcquireThread")
_JIT_CODE = re.compile(r"^0x[0-9a-f]+ \(\?\)$")
_JAX = re.compile(r"jaxlib|jax/_src|libjax")
_PY_FRAME = re.compile(r"^(?P<func>[^ ]+) \((?P<file>[^:)]+\.py):\d+\)$")


def classify(frames: list[str]) -> str:
    """One sample's category from its stack (outermost frame first, as py-spy's collapsed format)."""
    waiting = any(_WAIT.search(f) for f in frames[-4:])
    if waiting and any(_GIL_TAKE.search(f) for f in frames[-6:]):
        return "GIL wait"  # a thread that has finished native work and waits to take the GIL back
    if waiting and any(_JAX.search(f) for f in frames):
        return "XLA compute"  # XLA's own threads are not Python threads: the caller waiting on them stands in
    if waiting:
        return IDLE
    for frame in frames:  # torch: the outermost aten op called (what the Python code asked for)
        m = _ATEN_OP.search(frame)
        if m:
            py_files = [p.group("file") for f in frames if (p := _PY_FRAME.match(f))]
            if py_files and "sampler.py" in py_files[-1]:
                return "sampling"
            op = m.group(1) or m.group(3)
            for pattern, category in _ATEN:
                if re.match(pattern, op):
                    return category
            return "elementwise"
    if frames and _JIT_CODE.match(frames[-1]):
        return "matmul"  # code with no symbol: oneDNN/MKL's JIT-generated GEMM kernels
    for frame in reversed(frames):  # XLA: the innermost thunk or library that runs
        for pattern, category in _XLA:
            if re.search(pattern, frame):
                return category
    py_files = [p.group("file") for f in frames if (p := _PY_FRAME.match(f))]
    for file in reversed(py_files):  # the innermost Python module that names a category
        for pattern, category in _PYTHON_MODULES:
            if re.search(pattern, file):
                return category
    return "python" if py_files else "other native"  # the interpreter running pdserve's own code


def breakdown(collapsed: str) -> dict[str, float]:
    """Share of the busy samples per category from py-spy's raw output (`frame;frame;... count` lines);
    idle samples are counted apart."""
    counts: Counter[str] = Counter()
    for line in collapsed.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        counts[classify(stack.split(";"))] += int(n)
    idle = counts.pop(IDLE, 0)
    total = sum(counts.values())
    shares = {c: counts[c] / total for c in CATEGORIES if counts[c]} if total else {}
    return shares | {"samples": total, "idle_samples": idle}


class Sampler:
    """py-spy recording one process for as long as its `with` block runs."""

    def __init__(self, pid: int, raw: Path, rate: int) -> None:
        self.raw = raw
        self.cmd = [_py_spy(), "record", "--native", "--format", "raw", "--rate", str(rate), "--pid", str(pid),
                    "--output", str(raw)]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> Self:
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(1.0)  # py-spy attaches
        if self.proc.poll() is not None:
            raise SystemExit(f"py-spy could not attach: {self.proc.stderr.read().strip()}\n"
                             "It needs ptrace rights (run as the workers' user, or as root, or with "
                             "CAP_SYS_PTRACE; in a container: --cap-add SYS_PTRACE).")
        return self

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(2)  # SIGINT: py-spy writes what it has and exits
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def result(self) -> dict[str, float]:
        return breakdown(self.raw.read_text()) if self.raw.exists() else {"samples": 0}


def _py_spy() -> str:
    found = shutil.which("py-spy") or (Path(sys.executable).parent / "py-spy")
    if not Path(found).exists():
        raise SystemExit("py-spy is missing: `pip install py-spy` (it is in pdserve's dev extra)")
    return str(found)


def _requests(n: int, input_len: int, output_len: int, seed: int, group: str = "default"):
    return synthetic(n, input_len=input_len, output_len=output_len, vocab_size=VOCAB_SIZE, seed=seed, group=group)


async def _profiles(server, args, out: Path) -> dict[str, dict]:
    prefill, decode, coordinator = (p.pid for p in server.procs)
    target = server.make_target()
    results = {}
    try:
        batch = args.decode_batch
        await warmup(target, _requests(batch, 32, 4, 9), batch)
        for n in args.prefill_lens:
            await warmup(target, _requests(1, n, 1, 9), 1)
        decode_group = Group("decode", _requests(batch, 32, args.decode_len, 5, "decode"),
                             LoadSpec(concurrency=batch), max_requests=batch * args.decode_rounds)
        for name, pid in (("decode", decode), ("coordinator", coordinator)):
            print(f"== profiling the {name} while {batch} requests decode {args.decode_len} tokens each",
                  file=sys.stderr, flush=True)
            with Sampler(pid, out / f"{name}-b{batch}.raw.txt", args.rate) as s:
                await run_groups(target, [decode_group], duration=None, progress=False)
            results[f"{name} (decode batch {batch})"] = s.result()
        for n in args.prefill_lens:
            print(f"== profiling the prefill worker on {args.prefill_requests} prompts of {n} tokens",
                  file=sys.stderr, flush=True)
            group = Group(f"prefill-{n}", _requests(args.prefill_requests, n, 1, 6, f"prefill-{n}"),
                          LoadSpec(concurrency=1), max_requests=args.prefill_requests)
            with Sampler(prefill, out / f"prefill-{n}.raw.txt", args.rate) as s:
                await run_groups(target, [group], duration=None, progress=False)
            results[f"prefill ({n} tokens)"] = s.result()
    finally:
        await target.close()
    return results


def table(results: dict[str, dict]) -> str:
    used = [c for c in CATEGORIES if any(c in r for r in results.values())]
    lines = ["| process (load) | samples | " + " | ".join(used) + " |",
             "|---|---:|" + "---:|" * len(used)]
    for name, r in results.items():
        cells = [f"{100 * r[c]:.0f}%" if c in r else "-" for c in used]
        lines.append(f"| {name} | {r['samples']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="checkpoint dir (default: make the Qwen2.5-0.5B-shaped one)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--decode-batch", type=int, default=4)
    p.add_argument("--decode-len", type=int, default=64, help="tokens each decoding request generates")
    p.add_argument("--decode-rounds", type=int, default=2, help="batches of requests per decode profile")
    p.add_argument("--prefill-lens", type=lambda s: [int(x) for x in s.split(",")], default=[512, 2048])
    p.add_argument("--prefill-requests", type=int, default=4, help="prompts per prefill profile, one at a time")
    p.add_argument("--rate", type=int, default=100, help="py-spy samples per second (each pauses the process briefly)")
    p.add_argument("--max-load", type=float, default=2.0)
    p.add_argument("--allow-noisy", action="store_true", help="run on a busy machine, marking the result noisy")
    p.add_argument("--out", type=Path, default=RESULTS / "profile")
    return p


def main(argv: list[str] | None = None) -> int:
    from pdserve.benchmarks.servers import start_pdserve

    args = build_parser().parse_args(argv)
    _py_spy()
    record = MachineRecord.take()
    gate(record, args.max_load, args.allow_noisy)
    out = args.out / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    cache = cache_dir()
    model = args.model or make_qwen25_05b_shape(cache / "models" / f"qwen2.5-0.5b-shape-random-{args.dtype}",
                                                args.dtype)
    print(f"== starting pdserve on {model.name} (prefill core 0, decode core 1) ...", file=sys.stderr, flush=True)
    server = start_pdserve(model, args.dtype, out, "grpc")
    try:
        with LoadMonitor() as monitor:
            results = asyncio.run(_profiles(server, args, out))
    finally:
        server.stop()
    record.finish(monitor)
    cmd = "python -m pdserve.benchmarks.load.profile " + " ".join(argv if argv is not None else sys.argv[1:])
    doc = (f"`{cmd.strip()}` (model {model.name}, {args.dtype}; share of busy samples per category)\n\n"
           f"{record.markdown()}\n\n{table(results)}\n")
    (out / "profile.md").write_text(doc)
    (out / "profile.json").write_text(json.dumps({"config": {k: str(v) for k, v in vars(args).items()},
                                                  "machine": record.as_dict(), "results": results}, indent=1))
    print(doc)
    print(f"written: {out / 'profile.md'} (raw stacks beside it: flamegraph.pl *.raw.txt > x.svg)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
