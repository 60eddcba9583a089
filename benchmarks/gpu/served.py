"""The served pair on the device, `benchmarks/gpu.py`'s `served` stage: a prefill worker (JAX), a decode worker
(torch) and a coordinator, each its own process on this host (`boot.py cli ROLE`: the checkout's
`pdserve`, the carried wheels), driven through the public gRPC API as a client would.

1. Parity: a tiny random llama checkpoint (fp32, `checks.tiny_llama`: the correctness stage's) served by the pair
   on the device; the greedy tokens of 3 prompts through the coordinator equal transformers' `generate` on the
   same device (`checks.hf_greedy`: made once per device type, so a dry run reads the correctness stage's).
2. Speed: a random Llama-3-8B-shape bf16 checkpoint (`write_random_checkpoint`: safetensors, 16 GB, to /dev/shm
   when it has room; a word-level tokenizer over the whole vocabulary) served by a fresh pair; TTFT and
   inter-token latency through `Generate` at 1k- and 4k-token prompts of random ids, batch 1 and 32 (requests
   sent together), OUTPUT_TOKENS tokens each. Points that would not fit the stage's deadline are skipped.
Memory on one GPU: the prefill worker starts first, its JAX capped at PREFILL_MEM_FRACTION of the device and
allocating as it goes (XLA_PYTHON_CLIENT_MEM_FRACTION, XLA_PYTHON_CLIENT_PREALLOCATE=false); the decode worker
sizes its KV cache after it (--gpu-memory-utilization DECODE_UTILIZATION, less what it finds held by others).
The workers run in this process's group: `gpu.py` kills them with the stage when it overruns.
Dry run (CPU): tiny checkpoints for both parts, prompts of 16 and 48 tokens, batch 1 and 4.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

PREFILL_MEM_FRACTION = 0.35
DECODE_UTILIZATION = 0.5
OUTPUT_TOKENS = 32
POINTS = ((1024, 1), (1024, 32), (4096, 1), (4096, 32))
"""(prompt tokens, batch), in the order they run."""
DRY_POINTS = ((16, 1), (48, 4))
BOOT = Path(__file__).resolve().parent / "boot.py"


@dataclass
class Worker:
    name: str
    role: str
    address: str
    popen: subprocess.Popen
    log: Path

    def tail(self, chars: int = 2500) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class Pair:
    """A coordinator, a prefill worker and a decode worker on 127.0.0.1, started in that order, each waited
    for (the workers until the coordinator lists them ready); `stop` ends them, workers first."""

    def __init__(self, model: Path, work: Path, device: str, env: dict[str, str], prefill_args: list[str],
                 decode_args: list[str], log):
        self.model, self.work, self.device, self.log = model, work, device, log
        self.env = dict(os.environ, PDSERVE_LOG_LEVEL="INFO", **env)
        self.prefill_args, self.decode_args = prefill_args, decode_args
        self.workers: list[Worker] = []

    def start(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        coordinator = self._spawn("coordinator", "coordinator", ["--heartbeat-timeout", "5"])
        self._wait(lambda: self._serving(coordinator), coordinator, deadline)
        jax_env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_MEM_FRACTION": str(PREFILL_MEM_FRACTION)}
        if self.device == "cpu":
            jax_env["JAX_PLATFORMS"] = "cpu"
        for role, args, env in (("prefill", self.prefill_args, jax_env), ("decode", self.decode_args, {})):
            t = time.monotonic()
            worker = self._spawn(role, role, ["--coordinator", coordinator.address, *args], env)
            self._wait(lambda w=worker: self._ready(coordinator, w), worker, deadline)
            self.log(f"served pair: {role} worker ready in {time.monotonic() - t:.1f} s")
        self.coordinator = coordinator

    def _spawn(self, name: str, role: str, args: list[str], env: dict[str, str] | None = None) -> Worker:
        from pdserve.server.launcher import free_port

        port = free_port()
        log = self.work / f"{self.model.name}-{name}.log"
        cmd = [sys.executable, *(["-S"] if sys.flags.no_site else []), str(BOOT), "cli", role,
               "--model", str(self.model), "--host", "127.0.0.1", "--port", str(port), *args]
        with open(log, "w") as out:  # this process's group: killed with the stage
            popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                     env=dict(self.env, PDSERVE_PROCESS=name, **(env or {})))
        worker = Worker(name, role, f"127.0.0.1:{port}", popen, log)
        self.workers.append(worker)
        return worker

    def _wait(self, ready, worker: Worker, deadline: float) -> None:
        while not ready():
            if worker.popen.poll() is not None:
                raise RuntimeError(f"{worker.name} exited with {worker.popen.returncode}:\n{worker.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{worker.name} not ready in time:\n{worker.tail()}")
            time.sleep(0.5)

    @staticmethod
    def _serving(worker: Worker) -> bool:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            with grpc.insecure_channel(worker.address) as ch:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
            return True
        except grpc.RpcError:
            return False

    @staticmethod
    def _ready(coordinator: Worker, worker: Worker) -> bool:
        import grpc

        from pdserve.v1 import worker_pb2 as pb
        from pdserve.v1 import worker_pb2_grpc

        try:
            with grpc.insecure_channel(coordinator.address) as ch:
                listed = worker_pb2_grpc.RegistryStub(ch).ListWorkers(pb.ListWorkersRequest(), timeout=2).workers
        except grpc.RpcError:
            return False
        return any(w.address == worker.address and w.state == "ready" for w in listed)

    def stop(self) -> None:
        for w in sorted(self.workers, key=lambda w: w.role == "coordinator"):
            if w.popen.poll() is None:
                w.popen.send_signal(signal.SIGTERM)
        for w in self.workers:
            try:
                w.popen.wait(20)
            except subprocess.TimeoutExpired:
                w.popen.kill()
                w.popen.wait()


async def _generate(address: str, prompts: list[list[int]], max_tokens: int):
    """Every prompt sent at once through `Generate` (greedy, ignore_eos) -> their `RequestOutput`s."""
    from pdserve.benchmarks.clients import GrpcTarget
    from pdserve.server.plan.run_summary import RequestOutput
    from pdserve.server.plan.datasets import BenchRequest

    target = GrpcTarget(address, timeout=300)
    outs = [RequestOutput("served", len(p)) for p in prompts]
    try:
        await asyncio.gather(*(target.send(BenchRequest(len(p), max_tokens, prompt_ids=tuple(p)), o)
                               for p, o in zip(prompts, outs)))
    finally:
        await target.close()
    return outs


def _tokens(address: str, prompt: list[int], n: int) -> list[int]:
    import grpc

    from pdserve.v1 import generation_pb2 as gen_pb
    from pdserve.v1 import generation_pb2_grpc

    req = gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=prompt), sampling=gen_pb.SamplingParams(
        max_tokens=n, temperature=0.0, ignore_eos=True))
    with grpc.insecure_channel(address) as ch:
        return [t for m in generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=120) for t in m.token_ids]


def write_random_checkpoint(out: Path, raw_config: dict, device, seed: int = 0) -> Path:
    """An HF llama checkpoint of raw_config's shape with random bf16 weights (made on the device, one random
    tensor per shape shared by the layers: values do not change a step's cost), one safetensors shard per
    4 layers, and a word-level tokenizer ("t0" .. "t{V-1}") over the whole vocabulary."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    out.mkdir(parents=True, exist_ok=True)
    c = raw_config
    H, I, V = c["hidden_size"], c["intermediate_size"], c["vocab_size"]  # noqa: E741
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    g = torch.Generator(device=device).manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=device) * 0.02).to(torch.bfloat16).cpu()

    shapes = {"self_attn.q_proj.weight": (q, H), "self_attn.k_proj.weight": (kv, H), "self_attn.v_proj.weight": (kv, H),
              "self_attn.o_proj.weight": (H, q), "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H),
              "mlp.down_proj.weight": (H, I)}
    shared = {name: normal(*shape) for name, shape in shapes.items()}
    ones = torch.ones(H, dtype=torch.bfloat16)
    weight_map = {}
    L = c["num_hidden_layers"]
    for first in range(0, L, 4):
        shard = f"model-{first // 4:05d}.safetensors"
        tensors = {}
        for i in range(first, min(first + 4, L)):
            for name, t in shared.items():
                tensors[f"model.layers.{i}.{name}"] = t
            tensors[f"model.layers.{i}.input_layernorm.weight"] = ones
            tensors[f"model.layers.{i}.post_attention_layernorm.weight"] = ones
        save_file({k: v.clone() for k, v in tensors.items()}, str(out / shard))  # shared tensors: one copy each
        weight_map.update(dict.fromkeys(tensors, shard))
    tail = {"model.embed_tokens.weight": normal(V, H), "model.norm.weight": ones, "lm_head.weight": normal(V, H)}
    save_file(tail, str(out / "model-tail.safetensors"))
    weight_map.update(dict.fromkeys(tail, "model-tail.safetensors"))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(c, indent=1))
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": f"t{c['bos_token_id']}",
        "eos_token": f"t{c['eos_token_id']}", "add_bos_token": False}))
    return out


def _scratch(nbytes: int) -> Path:
    """/dev/shm when it has room for nbytes (reads at memory speed), else the temporary directory."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 1.2 * nbytes:
        return Path(tempfile.mkdtemp(prefix="pdserve-served-", dir=shm))
    return Path(tempfile.mkdtemp(prefix="pdserve-served-"))


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(out, device, *, dry_run: bool, row_type, log) -> None:
    """The stage: `out` is run.py's StageResult (rows, checks and notes saved as they come)."""
    import numpy as np

    from pdserve.benchmarks.gpu.run import LLAMA3_8B, TINY
    from pdserve.benchmarks.gpu.checks import PARITY_PROMPTS, Check, hf_greedy, tiny_llama

    dev = "cuda" if device.type == "cuda" else "cpu"
    decode_memory = ["--gpu-memory-utilization", str(DECODE_UTILIZATION)] if dev == "cuda" else \
        ["--kv-cache-memory", "256MiB"]
    common = ["--max-model-len", "4224" if not dry_run else "256"]
    prefill_args = [*common, "--prefix-cache-bytes", "0", "--max-batch-tokens", "4096" if not dry_run else "256"]
    decode_args = [*common, "--device", dev, "--max-running", "32" if not dry_run else "4", "--no-enable-prefix-caching",
                   *decode_memory]
    work = out.path.parent / "served-logs"  # the workers' logs come back with the results (a failure names them)
    work.mkdir(parents=True, exist_ok=True)

    # 1. parity: a tiny fp32 llama (the correctness stage's, when it ran: its checkpoint and its transformers
    # tokens on this device are read, not made again), greedy through the pair against transformers on the device
    tiny = tiny_llama(out.path.parent)
    prompts = PARITY_PROMPTS
    n = 8
    expected = hf_greedy(tiny, prompts, n, device)
    pair = Pair(tiny, work, dev, {"JAX_DEFAULT_MATMUL_PRECISION": "highest"},
                [*prefill_args, "--dtype", "float32"], [*decode_args, "--dtype", "float32"], log)
    try:
        pair.start(timeout=max(30.0, min(150.0, out.deadline.left() / 2)))
        got = [_tokens(pair.coordinator.address, p, n) for p in prompts]
        out.check(Check(f"served pair greedy tokens = transformers' ({dev}, tiny llama fp32, 3 prompts)",
                        got == expected, f"got {got}, transformers {expected}", group="served"))
    except Exception as e:  # noqa: BLE001 - recorded; the speed part still runs
        out.check(Check(f"served pair greedy tokens = transformers' ({dev}, tiny llama fp32, 3 prompts)", False,
                        f"raised {e!r}; logs: " + " | ".join(f"{w.name}: {w.tail(600)}" for w in pair.workers),
                        group="served"))
    finally:
        pair.stop()

    # 2. speed: a random Llama-3-8B-shape bf16 checkpoint through a fresh pair
    raw = dict(TINY if dry_run else LLAMA3_8B, max_position_embeddings=8192)
    if not out.allows("served pair speed (checkpoint, start, points)", 60 if dry_run else 150):
        return
    t = time.perf_counter()
    model = write_random_checkpoint(_scratch(17 * 2**30 if not dry_run else 2**20) / "llama-3-8b-shape", raw, device)
    out.note(f"served pair: random {'tiny' if dry_run else 'Llama-3-8B-shape'} bf16 checkpoint written in "
             f"{time.perf_counter() - t:.1f} s to {model}")
    pair = Pair(model, work, dev, {}, prefill_args, decode_args, log)
    try:
        t = time.perf_counter()
        pair.start(timeout=max(30.0, out.deadline.left() - 30))
        out.note(f"served pair: started in {time.perf_counter() - t:.1f} s")
        rng = np.random.default_rng(0)
        for length, batch in (DRY_POINTS if dry_run else POINTS):
            if not out.allows(f"served pair prompt {length} batch {batch}", 20 if not dry_run else 5):
                continue
            prompts = [rng.integers(0, raw["vocab_size"], length).tolist() for _ in range(batch)]
            outs = asyncio.run(_generate(pair.coordinator.address, prompts, OUTPUT_TOKENS))
            failed = [o.error for o in outs if not o.success]
            if failed:
                out.note(f"served pair prompt {length} batch {batch}: {len(failed)} of {batch} failed: {failed[0]}")
                continue
            ttft = [o.ttft for o in outs]
            tpot = [(o.chunk_times[-1] - o.chunk_times[0]) / max(1, sum(o.chunk_tokens) - o.chunk_tokens[0])
                    for o in outs]
            itl = [x for o in outs for x in o.itl]
            what = f"prompt {length} batch {batch}"
            out.row(row_type("served", f"TTFT median {what} (gRPC Generate, P/D pair)", statistics.median(ttft) * 1e3,
                             unit="ms"),
                    row_type("served", f"TTFT p90 {what}", _pct(ttft, 0.9) * 1e3, unit="ms"),
                    row_type("served", f"time per output token median {what} ({OUTPUT_TOKENS} tokens)",
                             statistics.median(tpot) * 1e3, unit="ms"),
                    row_type("served", f"inter-chunk latency p90 {what}", _pct(itl, 0.9) * 1e3 if itl else 0.0,
                             unit="ms"))
    finally:
        pair.stop()
        shutil.rmtree(model.parent, ignore_errors=True)
