"""Starts one prefill worker process: load the model into JAX, compile, serve.

In a slice of several processes (`--coordinator-address`, README "Prefill on a device mesh"), process 0
is the worker and every other process replays its steps (replay.py) with no server of its own.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import jax

from pdserve.kvcache.grpc_sender import GrpcKvTransport
from pdserve.kvcache.kv_event_publisher import ZmqEventPublisher, open_publisher
from pdserve.v1 import worker_pb2_grpc
from pdserve.server import hardware, metrics, serving
from pdserve.server.cache_dir import compile_cache_dir
from pdserve.server.model.config import ModelConfig, ModelLoadError, load_config
from pdserve.server.model.fingerprint import fingerprint
from pdserve.server.model.fp8_checkpoint import load_note
from pdserve.server.model.weights import load_weights
from pdserve.server.prefill.config import PrefillConfig
from pdserve.server.prefill.engine import PrefillEngine
from pdserve.server.prefill.executables import ExecutableCache
from pdserve.server.prefill.matmul import OnednnWeights, xla_matmul
from pdserve.server.prefill.matmul_choice import PATH_DTYPES, MatmulChoice, choose, choose_attention
from pdserve.server.prefill.model import compute_dtype, load_params, served_weight_dtype
from pdserve.server.prefill.quant import param_bytes
from pdserve.server.prefill.rates import queued_seconds
from pdserve.server.prefill.replay import SliceLeader, coordinator_host, follow
from pdserve.server.prefill.service import PrefillService
from pdserve.server.prefill.step_inputs import StepInputs
from pdserve.server.prefill.sharding import default_size, make_mesh, shard_params, start_distributed
from pdserve.server.prefill.warmup import Warmup, cores
from pdserve.server.kv_events_source import kv_events_source
from pdserve.server.registration import Memberships, join, serve_until_signal
from pdserve.server.structured.grammars import Grammars

log = logging.getLogger("pdserve.prefill")

SERVICES = ["pdserve.v1.Prefill", "pdserve.v1.Control"]


@dataclass
class PrefillWorker:
    server: object
    service: PrefillService
    port: int
    health: object = None
    registration: Memberships | None = None
    kv_publisher: ZmqEventPublisher | None = None
    """Publishes the host prefix KV's events (--kv-events-config), or None."""

    async def drain(self, seconds: float) -> None:
        """No new Prefill calls, the coordinator told; running prefills and KV pushes finish."""
        self.service.draining = True
        await serving.drain(self.health, SERVICES, self.service.busy, seconds,
                            self.registration.beat if self.registration else None)

    async def stop(self, grace: float = 1.0) -> None:
        if self.registration is not None:
            await self.registration.close()
        await self.server.stop(grace)
        await self.service.transport.close()
        if self.service.engine.compiling is not None:
            await asyncio.to_thread(self.service.engine.compiling.stop)
        self.service.engine.close()
        if self.kv_publisher is not None:
            self.kv_publisher.close()


def compute_path(engine: PrefillEngine) -> str:
    """What the layers' matmuls compute in, and where: "float32 matmuls on XLA:CPU", "bfloat16 matmuls on XLA:TPU",
    or "bfloat16 matmuls on oneDNN (attention on the host, the rest on XLA:CPU)" (`--prefill-matmul onednn-bf16`)."""
    backend = jax.default_backend().upper()
    if engine.matmul_path.startswith("onednn"):
        where = "attention on the host, " if engine.attention_path.startswith("host") else ""
        return f"bfloat16 matmuls on oneDNN ({where}the rest on XLA:{backend})"
    dtype = "bfloat16" if engine.matmul_path.startswith("xla-bf16") else \
        compute_dtype(engine.model_config, str(engine.dtype), jax.default_backend())
    return f"{dtype} matmuls on XLA:{backend}"


async def start(config: PrefillConfig, options: serving.WorkerOptions = serving.WorkerOptions(),
                engine: PrefillEngine | None = None) -> PrefillWorker:
    engine = engine or load_engine(config)
    server, health, port = serving.new_server(SERVICES, config.port, config.host)
    transport = GrpcKvTransport(num_streams=config.kv_streams, channel_options=serving.CHANNEL_OPTIONS,
                                credentials=serving.channel_credentials(), interceptors=serving.channel_interceptors())
    model_config = engine.model_config
    found = hardware.Hardware(cpu=hardware.cpu(), jax=hardware.jax_probe(), device=jax.default_backend(),
                              paths={"compute": compute_path(engine), "matmuls": engine.matmul_path})
    log.info("prefill hardware: %s", found.describe())
    service = PrefillService(engine, transport, model_config,
                             fingerprint=fingerprint(config.model_dir, model_config),
                             address=options.advertise_address or f"{config.host}:{port}", hardware=found)
    kv_publisher = None
    if engine.prefix.cache.events is not None:
        kv_publisher = engine.prefix.cache.events.publisher = open_publisher(config.kv_events, service.address)
        service.kv_events = kv_events_source(kv_publisher, config.kv_events.endpoint, service.address,
                                             engine.prefix.cache.hasher, engine.prefix.block_size)
        log.info("KV events: publishing on %s (topic %r%s)", kv_publisher.endpoint, kv_publisher.topic.decode(),
                 f", replay on {kv_publisher.replay_endpoint}" if kv_publisher.replay_endpoint else "")
    worker_pb2_grpc.add_PrefillServicer_to_server(service, server)
    worker_pb2_grpc.add_ControlServicer_to_server(service, server)
    await server.start()
    await serving.set_serving(health, SERVICES, True)
    metrics.identify(config.model_name, "prefill", model_config.max_model_len)
    metrics.prefill_queued_tokens.set_function(lambda: engine.queued_tokens)
    metrics.prefill_queued_seconds.set_function(lambda: queued_seconds(engine.load(waits=False)))
    metrics.prefill_padding_share.set_function(lambda: engine.padding_share)
    metrics.prefill_compiles_pending.set_function(lambda: engine.compiling.pending if engine.compiling else 0)
    metrics.prefill_programs_compiled.set_function(lambda: engine.compiling.done if engine.compiling else 0)
    metrics.prefill_programs_total.set_function(lambda: len(engine.compiling.jobs) if engine.compiling else 0)
    metrics.prefill_compile_waits.inc(0)  # exported from the start, at 0
    metrics.num_requests_running.set_function(lambda: service.active)
    metrics.serve_metrics(options.metrics_port, config.host)
    log.info("prefill worker listening on %s:%d", config.host, port)
    worker = PrefillWorker(server, service, port, health, kv_publisher=kv_publisher)
    if options.coordinator:
        await join(worker, options.coordinator, service.info)
    return worker


def _check_latent_attention(model_config: ModelConfig, config: PrefillConfig, processes: int) -> None:
    """What the prefill tier does not do for DeepSeek's latent attention yet, refused at start (ModelLoadError).
    A mesh of one process's devices serves it (heads over tp, experts over ep x tp: sharding.py)."""
    if processes > 1:
        raise ModelLoadError(f"{model_config.family}: the prefill tier serves latent attention (MLA) on the devices of "
                             f"one process (a mesh of them: --tensor-parallel-size, --expert-parallel-size); a slice "
                             f"of {processes} processes is not built for it: drop --coordinator-address / "
                             f"--num-processes and run one prefill worker per host")
    if config.prefill_matmul == "onednn-bf16":
        raise ModelLoadError(f"--prefill-matmul onednn-bf16: the prefill tier computes {model_config.family}'s latent "
                             f"attention with XLA's matmuls only; pass --prefill-matmul auto, xla-fp32 or xla-bf16")
    if config.weight_dtype not in ("auto", "float32", "bfloat16"):
        raise ModelLoadError(f"--weight-dtype {config.weight_dtype}: the prefill tier serves {model_config.family} "
                             f"(latent attention) with float32 or bfloat16 weights only; use --weight-dtype auto")


def load_engine(config: PrefillConfig, progress: bool = True, serving: bool = False) -> PrefillEngine:
    """The model loaded (and sharded over the device mesh), every batch shape compiled; `serving`: only
    those --compile-before-serving names, the rest compiling in the background (warmup.py) while the
    worker serves, its steps packed into the shapes compiled so far (`engine.compiling`). On process 0
    of a slice of several processes, once the others have connected, the engine sends them every step."""
    use_compilation_cache(config.compilation_cache)  # before the first compile
    leader = None
    if start_distributed(config.coordinator_address, config.num_processes, config.process_id):
        log.info("joined a %d-process slice as process %d", jax.process_count(), jax.process_index())
        if jax.process_count() > 1 and jax.process_index() == 0:  # published now: followers look it up when ready
            leader = SliceLeader.listen(jax.process_count() - 1, coordinator_host(), _cluster_secret())
    if config.enable_lora and jax.process_count() > 1:  # a TPU slice found without --num-processes
        raise ValueError("--enable-lora is served by a prefill worker of one process so far; this slice has "
                         f"{jax.process_count()}: serve adapters from single-host prefill workers")
    model_config = load_config(config.model_dir).limited_to(config.max_model_len)
    ep = config.expert_parallel_size
    tp = config.tensor_parallel_size or default_size(model_config, jax.device_count(), expert_parallel=ep)
    if model_config.mla is not None:
        _check_latent_attention(model_config, config, jax.process_count())
    choice = None if model_config.mla is not None else choose_matmul(config, model_config,
                                                                      devices=tp * ep * jax.process_count())
    forced = PATH_DTYPES.get(config.prefill_matmul) if model_config.mla is not None else None  # xla-fp32/-bf16
    dtype = choice.dtype if choice else forced or served_weight_dtype(config.weight_dtype, model_config.dtype,
                                                                      jax.default_backend())
    t0 = time.perf_counter()
    if note := load_note(config.model_dir, "prefill", str(dtype), jax.default_backend()):
        log.info("%s", note)
    params = load_params(model_config, load_weights(config.model_dir), dtype=dtype)
    matmul, held, where = xla_matmul, "", None
    if choice is not None and choice.path == "onednn-bf16":
        bank = OnednnWeights(threads=cores())
        params = dict(params, layers=bank.take(params["layers"]))
        t1 = time.perf_counter()
        where = choose_attention(config.prefill_attention, choice.path, model_config, cores())
        log.info("prefill attention: %s (chosen in %.1f s)", where.describe(), time.perf_counter() - t1)
        matmul, held = bank.kernels(host_attention=where.where == "host"), \
            f" + {bank.nbytes / 2**20:.1f} MiB prepacked for oneDNN, called " + \
            ("from C++ (onednn_native)" if bank.without_python else "through Python (host_call)")
    elif config.prefill_attention == "host":
        raise ValueError(f"--prefill-attention host runs beside --prefill-matmul onednn-bf16, and this worker's "
                         f"matmuls are {choice.path if choice else 'XLA'}: pass --prefill-attention auto or xla")
    if config.tensor_parallel_size is None and tp * ep < jax.device_count():
        log.warning("sharding over %d of %d devices: the model's %s (%d) do not split over more", tp * ep,
                    jax.device_count(), *(("heads", model_config.num_heads) if model_config.mla is not None else
                                          ("kv heads", model_config.num_kv_heads)))
    if tp * ep > 1 or jax.process_count() > 1:  # sharded at the edge; the model code is the same
        mesh = make_mesh(tp, ep)
        params = shard_params(params, mesh, model_config)
        if mesh.is_multi_process:
            log.info("the mesh holds devices %s of processes %s", [d.id for d in mesh.devices.flat],
                     [d.process_index for d in mesh.devices.flat])
    loaded = time.perf_counter() - t0
    grammars = Grammars.for_model(config.model_dir, params.get("lm_head", params["embed"]).shape[0],
                                  tuple(model_config.eos_token_ids), **Grammars.options(config))
    # (ModelRunner keeps the oneDNN path's programs out of it: they call the host's prepacked weights)
    executables = executable_cache(config) if jax.process_count() == 1 else None
    engine = PrefillEngine(model_config, params, config, grammars=grammars, matmul=matmul, executables=executables)
    if where is not None:
        engine.attention_path = where.describe()
    engine.matmul_path = choice.describe() if choice else (f"xla-{'bf16' if dtype == 'bfloat16' else 'fp32'}"
                                                           f" ({dtype} weights on XLA:{jax.default_backend().upper()})"
                                                           if dtype in ("float32", "bfloat16") else
                                                           f"XLA:{jax.default_backend().upper()} ({dtype} weights)")
    if grammars is not None:
        grammars.warm()
    warmup = Warmup(engine)
    before = config.compile_before_serving if serving else "all"
    if before != "all" and jax.process_count() > 1:  # every process must dispatch the same programs in order
        log.info("a slice of several processes compiles every shape before it serves (--compile-before-serving %s "
                 "applies to one process)", before)
        before = "all"
    first = warmup.first(before)
    compile_s = warmup.compile(first, threads=cores(), progress=progress)
    log.info("prefill model %s loaded in %.1f s (tensor parallel %d%s over %s); weights %.1f MiB%s (%s, compute %s, "
             "matmuls %s); %d of %d start-up programs (%d batch shapes) compiled in %.1f s%s", model_config.describe(),
             loaded, tp, f" x expert parallel {ep}" if ep > 1 else "", jax.default_backend(),
             param_bytes(params) / 2**20, held, dtype, compute_dtype(model_config, dtype, jax.default_backend()),
             engine.matmul_path.split(" (")[0], len(first), len(warmup.jobs),
             len(engine.shapes()), compile_s,
             "" if warmup.finished.is_set() else "; the others compile while it serves, when no prompt waits")
    if executables is not None:
        log.info("prefill executable cache: %s", executables.summary())
    engine.compiling = warmup  # its programs' count and what is compiled, for the metrics and the steps
    if not warmup.finished.is_set():
        warmup.start(threads=1)
    if leader is not None:
        leader.accept()
        engine.replay = leader
    return engine


def choose_matmul(config: PrefillConfig, model_config: ModelConfig, devices: int) -> MatmulChoice | None:
    """The layers' matmul path on the CPU backend (matmul_choice.py), logged with its timings; None elsewhere
    (TPU, GPU, a slice of several processes unless forced) and for quantized weights: XLA in the compute dtype
    `served_weight_dtype` gives, as before."""
    on_cpu = jax.default_backend() == "cpu"
    if config.weight_dtype in ("int8", "fp8") or (config.prefill_matmul == "auto" and (
            not on_cpu or jax.process_count() > 1)):  # a slice's processes must not each measure a different path
        return None  # (PrefillConfig refuses a forced path beside quantized weights)
    if not on_cpu and config.prefill_matmul == "onednn-bf16":
        raise ValueError(f"--prefill-matmul onednn-bf16 runs on the CPU backend, not {jax.default_backend()}: pass "
                         f"--prefill-matmul auto (XLA) there")
    onednn_bf16 = False
    maybe_bf16 = config.weight_dtype == "bfloat16" or config.weight_dtype == "auto" and model_config.dtype == "bfloat16"
    if on_cpu and (maybe_bf16 or config.prefill_matmul == "onednn-bf16"):
        try:
            onednn_bf16 = hardware.torch_probe().onednn_bf16
        except ImportError:  # a prefill image without torch: XLA only
            log.info("prefill matmul: torch is not installed here, so oneDNN's path is not a candidate")
    t0 = time.perf_counter()
    choice = choose(config.prefill_matmul, config.weight_dtype, model_config, onednn_bf16, devices, cores())
    log.info("prefill matmul: %s (chosen in %.1f s)", choice.describe(), time.perf_counter() - t0)
    return choice


def compilation_cache_dir(setting: str | Path) -> Path | None:
    """--compilation-cache's directory: auto: $JAX_COMPILATION_CACHE_DIR (jax_compilation_cache_dir) when
    set, else the machine's (cache_dir.py); none: None."""
    if str(setting) == "none":
        return None
    if str(setting) == "auto":
        return Path(jax.config.jax_compilation_cache_dir or compile_cache_dir())
    return Path(setting)


def executable_cache(config: PrefillConfig) -> ExecutableCache | None:
    """The compiled programs' cache (executables.py) in --compilation-cache's directory; None: off
    (--no-executable-cache, PDSERVE_EXECUTABLE_CACHE=0, or no compilation cache)."""
    directory = compilation_cache_dir(config.compilation_cache)
    if not config.executable_cache or os.environ.get("PDSERVE_EXECUTABLE_CACHE", "1") == "0" or directory is None:
        return None
    return ExecutableCache(directory / "pdserve-executables")


def use_compilation_cache(setting: str | Path) -> None:
    """JAX's persistent compilation cache in --compilation-cache's directory, caching every compile
    (however quick or small: XLA:CPU's programs are both), or none."""
    directory = compilation_cache_dir(setting)
    if directory is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        log.warning("no compilation cache (--compilation-cache): %s; every start compiles cold", e)
        return
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # -1: no minimum size, and no override
    log.info("compilation cache: %s", directory)


async def serve(config: PrefillConfig, options: serving.WorkerOptions = serving.WorkerOptions()) -> None:
    t0 = time.perf_counter()
    engine = load_engine(config, serving=True)
    if jax.process_index() > 0:
        await replay_steps(engine)
        return
    worker = await start(config, options, engine)
    log.info("prefill worker ready %.1f s after it began loading the model%s", time.perf_counter() - t0,
             "" if not engine.compiling.pending else f"; {engine.compiling.pending} start-up programs left to compile")
    await serve_until_signal(worker, "prefill", options.drain_seconds)


async def replay_steps(engine: PrefillEngine) -> None:
    """A follower of a slice: no server; runs process 0's steps until process 0 stops the slice (SIGTERM
    alone does not stop it: process 0 drains first, and its steps need every process)."""
    process = jax.process_index()
    asyncio.get_running_loop().add_signal_handler(
        signal.SIGTERM, lambda: log.info("prefill slice: SIGTERM; process %d exits when process 0 stops the slice",
                                         process))

    def run(inputs: StepInputs) -> None:
        engine.dispatch(inputs, to_host=False).wait()

    await asyncio.to_thread(follow, run, process, _cluster_secret())


def _cluster_secret() -> str | None:
    auth = serving.cluster_auth()
    return auth.secret if auth is not None else None
