"""The `pdserve` command: one subcommand per process role, plus `up`, `generate`, `plan`, helpers, and those
other packages add (COMMANDS: `pdserve bench`, the load generator)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.server.cache_dir import cache_dir
from pdserve.server.choices import (
    LOG_FORMATS,
    VLLM_DTYPES,
    VLLM_KV_CACHE_DTYPES,
    VLLM_QUANTIZATIONS,
    translate,
)
from pdserve.server.flags import add_flags, config_from_args, config_to_argv

if TYPE_CHECKING:
    from pdserve.server.coordinator.config import CoordinatorConfig
    from pdserve.server.decode.config import DecodeConfig
    from pdserve.server.model.config import ModelConfig
    from pdserve.server.prefill.config import PrefillConfig

DEFAULT_FAMILY = "llama"
TINY_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mistral-windowed", "gemma2", "gemma3", "mixtral",
                 "qwen3_moe", "deepseek_v2", "deepseek_v3")
"""make-tiny-model's --family choices (server/model/tiny.py `Family`)."""


def _setup_logging(log_format: str = "text") -> None:
    from pdserve.server.logs import setup_logging

    setup_logging(log_format)  # type: ignore[arg-type]


EMBEDDED_MODEL = Path(__file__).resolve().parent / "model" / "default"
"""A small Llama trained on Python standard-library sources (benchmarks/train_tiny.py), committed."""


def default_model_dir() -> Path:
    """The embedded default model: the committed trained checkpoint, else a random one built into the cache."""
    if (EMBEDDED_MODEL / "config.json").exists():
        print(f"serving the embedded default model from {EMBEDDED_MODEL}: a tiny Llama trained for minutes on the "
              f"Python standard library (it writes Python-flavoured text); pass --model DIR to serve a real HF "
              f"checkpoint", file=sys.stderr)
        return EMBEDDED_MODEL
    cache = cache_dir()
    out = cache / "models" / f"tiny-{DEFAULT_FAMILY}"
    if not (out / "config.json").exists():
        from pdserve.server.model.tiny import make_tiny_model

        print(f"building the default model into {out} ...", file=sys.stderr)
        make_tiny_model(out.with_suffix(".partial"), DEFAULT_FAMILY)
        out.with_suffix(".partial").rename(out)
    print(f"serving the embedded default model from {out}: a tiny {DEFAULT_FAMILY} with RANDOM weights, "
          f"so its text is noise; pass --model DIR to serve a real HF checkpoint", file=sys.stderr)
    return out


def _model_arg(p: argparse.ArgumentParser, required: bool = True) -> None:
    """The model, as vLLM takes it: positional or --model; a local directory or a Hugging Face model id."""
    p.set_defaults(model_required=required)
    p.add_argument("model_tag", nargs="?", metavar="MODEL",
                   help="a local HF checkpoint directory or a Hugging Face model id (as `vllm serve MODEL`)")
    p.add_argument("--model", help="the same, as a flag")
    p.add_argument("--revision", help="the model id's branch, tag or commit (default: main)")
    p.add_argument("--download-dir", type=Path,
                   help="the Hugging Face cache to read (and download into); default: HF_HUB_CACHE")


def _model_name(args) -> str | None:
    given = args.model or args.model_tag
    if args.model and args.model_tag and args.model != args.model_tag:
        raise SystemExit(f"pdserve: two models given: {args.model_tag!r} and --model {args.model!r}")
    if given is None and getattr(args, "model_required", False):
        raise SystemExit("pdserve: give the model: a checkpoint directory or a Hugging Face model id "
                         "(positional, or --model)")
    return given


def _resolve_model(args) -> Path | None:
    """The checkpoint directory for the given model (downloaded or read from the HF cache for an id)."""
    from pdserve.server.model.config import ModelLoadError
    from pdserve.server.model.hub import is_local, resolve_model

    given = _model_name(args)
    if given is None:
        return None
    try:
        path = resolve_model(given, revision=args.revision, download_dir=args.download_dir)
    except ModelLoadError as e:
        raise SystemExit(f"pdserve: cannot serve {given}: {e}")
    if not is_local(given) and not getattr(args, "served_model_name", None):
        args.served_model_name = (given,)  # vLLM's default name for a model id: the id itself
    return path


def _vllm_dtype_args(p: argparse.ArgumentParser, kv: bool = True) -> None:
    """vLLM's spellings of the weight and KV dtypes."""
    p.add_argument("--dtype", dest="vllm_dtype", metavar="DTYPE",
                   help=f"vLLM's weight dtype: {', '.join(VLLM_DTYPES)} (as --weight-dtype)")
    p.add_argument("--quantization", "-q", dest="vllm_quantization", metavar="METHOD",
                   help=f"vLLM's weight quantization: {', '.join(VLLM_QUANTIZATIONS)} (as --weight-dtype; "
                        "quantized weights compute in the checkpoint's dtype)")
    if kv:
        p.add_argument("--kv-cache-dtype", dest="vllm_kv_cache_dtype", metavar="DTYPE",
                       help=f"vLLM's KV cache dtype: {', '.join(VLLM_KV_CACHE_DTYPES)} (as --kv-dtype)")


def _dtypes(args, weight_flag: str = "weight_dtype", kv_flag: str | None = "kv_dtype") -> dict[str, str]:
    """The weight (and KV) dtype from pdserve's flags or vLLM's: --quantization, else --weight-dtype, else --dtype."""
    out = {}
    try:
        weight = getattr(args, weight_flag)
        if args.vllm_quantization is not None:
            weight = translate("--quantization", args.vllm_quantization, VLLM_QUANTIZATIONS)
        elif weight == "auto" and args.vllm_dtype is not None:
            weight = translate("--dtype", args.vllm_dtype, VLLM_DTYPES)
        out[weight_flag] = weight
        if kv_flag is not None:
            kv = getattr(args, kv_flag)
            if kv == "auto" and getattr(args, "vllm_kv_cache_dtype", None) is not None:
                kv = translate("--kv-cache-dtype", args.vllm_kv_cache_dtype, VLLM_KV_CACHE_DTYPES)
            out[kv_flag] = kv
    except ValueError as e:
        raise SystemExit(f"pdserve: {e}")
    return out


def _config(cls, args, **overrides):
    try:
        return config_from_args(cls, args, **overrides)
    except ValueError as e:
        raise SystemExit(f"pdserve: {e}")


def _server_args(p: argparse.ArgumentParser, port: int) -> None:
    p.add_argument("--port", type=int, default=port)
    p.add_argument("--host", default="127.0.0.1")


def _common_args(p: argparse.ArgumentParser) -> None:
    """Flags every server role takes: metrics, TLS, log format."""
    p.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus /metrics on this port (0: off)")
    p.add_argument("--tls-cert", type=Path, help="this process's certificate (PEM): TLS on every gRPC link")
    p.add_argument("--tls-key", type=Path, help="the certificate's private key (PEM)")
    p.add_argument("--tls-ca", type=Path, help="the CA to trust (PEM); servers then require client certs (mTLS)")
    p.add_argument("--cluster-secret-file", type=Path,
                   help="a file holding the cluster secret every internal RPC carries and needs "
                        "(or $PDSERVE_CLUSTER_SECRET_FILE); distinct from --api-key")
    p.add_argument("--log-format", choices=LOG_FORMATS, default="text")


def _worker_args(p: argparse.ArgumentParser) -> None:
    _common_args(p)
    p.add_argument("--coordinator", metavar="HOST:PORT[,HOST:PORT...]",
                   help="register with this coordinator and heartbeat; several replicas: a comma-separated list, "
                        "or a DNS name resolving to all of them (resolved again every 10 s)")
    p.add_argument("--advertise-address", metavar="HOST:PORT", help="the address peers dial (default HOST:PORT)")
    p.add_argument("--drain-seconds", type=float, default=60.0,
                   help="on SIGTERM, how long in-flight requests may take before the worker exits")


def _client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-ca", type=Path, help="the CA that signed the server's certificate (PEM): use TLS")
    p.add_argument("--tls-cert", type=Path, help="a client certificate (PEM), for mTLS")
    p.add_argument("--tls-key", type=Path, help="the client certificate's key (PEM)")


def _configure_tls(args) -> None:
    from pdserve.server import serving
    from pdserve.server.security import TlsConfig, resolve_cluster_secret

    try:
        serving.configure(TlsConfig(args.tls_cert, args.tls_key, args.tls_ca),
                          resolve_cluster_secret(args.cluster_secret_file))
    except ValueError as e:
        raise SystemExit(f"pdserve: {e}")


def _worker_options(args, kv_port: int | None = None):
    from pdserve.server.serving import WorkerOptions

    _configure_tls(args)
    return WorkerOptions(coordinator=args.coordinator, advertise_address=args.advertise_address,
                         metrics_port=args.metrics_port, kv_port=kv_port, drain_seconds=args.drain_seconds)


def _check_model(model_dir: Path, max_model_len: int | None = None) -> None:
    from pdserve.server.model.config import ModelLoadError, load_config
    from pdserve.server.model.weights import checkpoint_files

    try:
        load_config(model_dir).limited_to(max_model_len)
        checkpoint_files(model_dir)
    except ModelLoadError as e:
        raise SystemExit(f"pdserve: cannot serve {model_dir}: {e}")


UP_SHARED = ("served_model_name", "max_model_len", "grammar_processes", "grammar_timeout", "max_spec_bytes",
             "max_schema_depth", "max_schema_defs", "max_grammar_rules")
"""`pdserve up`'s flags that every tier takes."""
UP_LORA_COORDINATOR = ("enable_lora", "lora_modules", "max_lora_rank")
UP_LORA_WORKERS = ("enable_lora", "max_loras", "max_cpu_loras", "max_lora_rank", "lora_dtype")
"""vLLM's LoRA flags (`server/lora_config.py`): the coordinator checks and names the adapters, the prefill and
decode workers compute with them (each loads an adapter from its path on a request's first use)."""
UP_WORKERS = ("grammar_cache_bytes",)
"""`pdserve up`'s flags that both worker tiers take."""
UP_COORDINATOR = ("http_port", "chat_template", "ttft_budget", "stall_timeout", "max_coalesce", "decode_streams",
                  "enable_auto_tool_choice", "tool_call_parser", "max_tools", "max_tool_schema_bytes",
                  "conditional_disagg_max_uncached", "conditional_disagg_min_cached", "kv_events_subscribe",
                  "kv_overlap_score_weight")
KV_OFFLOADING = ("kv_offloading_backend", "kv_offloading_size", "kv_offloading_disk_path", "kv_offloading_disk_size",
                 "kv_offloading_shared_path", "kv_offloading_shared_size")
"""The offload tiers' flags (`server/kv_offloading.py`): every worker of `pdserve up` takes them (each its own
disk path under --kv-offloading-disk-path, `launcher.offloading_args`; the shared path as given)."""
UP_PREFILL = ("prefill_matmul", "prefill_attention", "tensor_parallel_size", "expert_parallel_size",
              "max_batch_tokens", "max_prefill_chunk",
              "prefix_cache_bytes", "kv_streams", "prefill_order", "compilation_cache", "compile_before_serving")
UP_DECODE = ("kv_dtype", "max_running", "gpu_memory_utilization", "kv_cache_memory", "cpu_matmul", "enforce_eager",
             "speculative_config", "kv_events_config", "prefix_caching_hash_algo", *KV_OFFLOADING)
UP_BOTH_WORKERS = ("kv_events_config", "prefix_caching_hash_algo", *KV_OFFLOADING)
"""Of UP_DECODE, the flags the prefill workers take too (their host prefix KV publishes and hashes alike); the
launcher gives each worker its own event ports (`launcher.kv_events_args`). The coordinator takes
--prefix-caching-hash-algo too (it hashes prompts to look them up in its KV index, which reads the workers' events
from the endpoints they advertise)."""
"""Beside these, up takes --prefill-weight-dtype, --decode-weight-dtype, --decode-device and --decode-engine:
the workers' --weight-dtype, --device and --engine, prefixed by their tier (add_flags' prefix)."""
VLLM_BLOCK_SIZE = 32
"""The decode workers' block size under --decode-engine vllm: vLLM's CPU attention takes blocks of 32 tokens
(and its CUDA backends multiples of 16)."""


def cmd_up(args) -> int:
    from pdserve.server import launcher, preflight

    if args.coordinators < 1:
        raise SystemExit(f"pdserve up: error: --coordinators must be >= 1, got {args.coordinators}")
    if args.prefill_workers < 0 or args.decode_workers < 1:
        raise SystemExit(f"pdserve up: error: --prefill-workers must be >= 0 and --decode-workers >= 1, got "
                         f"{args.prefill_workers} and {args.decode_workers}")
    model = _resolve_model(args) or default_model_dir()
    served = preflight.check_model(model, args.max_model_len)  # first: the other refusals assume a model
    http_port = launcher.free_port(args.host) if args.http_port == 0 else args.http_port
    coordinator, prefill, decode = _tier_configs(args, model, http_port)
    _preflight(args, served, prefill, decode)
    print(f"starting {args.prefill_workers} prefill and {args.decode_workers} decode workers ...", file=sys.stderr)
    secret_dir = None
    if args.cluster_secret_file is None:  # one fresh secret for this cluster's internal links
        import tempfile

        from pdserve.server.security import write_cluster_secret

        secret_dir = Path(tempfile.mkdtemp(prefix="pdserve-up-"))
        args.cluster_secret_file = write_cluster_secret(secret_dir / "cluster-secret")
    try:
        return _up(args, coordinator, prefill, decode)
    finally:
        if secret_dir is not None:
            import shutil

            shutil.rmtree(secret_dir, ignore_errors=True)


def _tier_configs(args, model: Path,
                  http_port: int | None) -> tuple[CoordinatorConfig, PrefillConfig, DecodeConfig]:
    """The coordinator's, the prefill workers' and the decode workers' configs from `pdserve up`'s flags: what
    up takes for the tier, its defaults for the rest (the port and host are the launcher's, per process).
    A setting a tier refuses is refused here, before anything starts, in up's spelling."""
    from pdserve.server.coordinator.config import CoordinatorConfig
    from pdserve.server.decode.config import DecodeConfig
    from pdserve.server.prefill.config import PrefillConfig

    prefill_weights = _dtypes(args, "prefill_weight_dtype", None)["prefill_weight_dtype"]
    decode_dtypes = _dtypes(args, "decode_weight_dtype", "kv_dtype")
    vllm = {"block_size": VLLM_BLOCK_SIZE} if args.decode_engine == "vllm" else {}
    try:
        return (
            config_from_args(CoordinatorConfig, args, only=UP_SHARED + UP_COORDINATOR + UP_LORA_COORDINATOR,
                             model_dir=model,
                             http_port=http_port, prefix_caching_hash_algo=args.prefix_caching_hash_algo),
            config_from_args(PrefillConfig, args, only=UP_SHARED + UP_WORKERS + UP_PREFILL + UP_LORA_WORKERS,
                             model_dir=model,
                             weight_dtype=prefill_weights, **{k: getattr(args, k) for k in UP_BOTH_WORKERS}),
            config_from_args(DecodeConfig, args, only=UP_SHARED + UP_WORKERS + UP_DECODE + UP_LORA_WORKERS,
                             model_dir=model,
                             weight_dtype=decode_dtypes["decode_weight_dtype"], kv_dtype=decode_dtypes["kv_dtype"],
                             device=args.decode_device, engine=args.decode_engine, **vllm),
        )
    except ValueError as e:
        raise ValueError(str(e).replace("--device", "--decode-device")) from e


def _preflight(args, served: ModelConfig, prefill: PrefillConfig, decode: DecodeConfig) -> None:
    """Refuses, before any process starts, what would fail one after others had (server/preflight.py): the
    tiers' frameworks, dtypes and devices, for the model `preflight.check_model` passed."""
    from pdserve.server import preflight

    if args.prefill_workers:
        preflight.check_prefill_tier(served, prefill.weight_dtype)
    if decode.engine == "vllm":
        preflight.check_vllm_model(served)
    preflight.check_decode_tier(decode.engine, args.decode_python or sys.executable, decode.device)


def _up(args, coordinator: CoordinatorConfig, prefill: PrefillConfig, decode: DecodeConfig) -> int:
    from pdserve.server import launcher

    launched: list[launcher.Cluster] = []
    if args.metrics_port:  # the supervisor's restarts and every process's own series (cluster_metrics.py)
        from pdserve.server import metrics
        from pdserve.server.cluster_metrics import serve_cluster_metrics

        metrics.identify(coordinator.model_name, "supervisor", at_zero=False)
        serve_cluster_metrics(args.metrics_port, args.host, lambda: launched[0].metrics_targets() if launched else [],
                              coordinator.model_name)
    try:
        cluster = launcher.launch(coordinator.model_dir, prefill_workers=args.prefill_workers,
                                  decode_workers=args.decode_workers, port=args.port, host=args.host,
                                  coordinator_args=config_to_argv(coordinator),
                                  common_args=["--cluster-secret-file", str(args.cluster_secret_file)],
                                  prefill_args=config_to_argv(prefill), decode_args=config_to_argv(decode),
                                  decode_python=args.decode_python or sys.executable,
                                  coordinators=args.coordinators, metrics=True)
    except (RuntimeError, TimeoutError) as e:
        print(f"pdserve up failed: {e}", file=sys.stderr)
        return 1
    launched.append(cluster)
    state = cluster.describe()
    if args.state_file:
        launcher.write_state(cluster, args.state_file)
    if args.coordinators > 1:
        print(f"{args.coordinators} coordinator processes share {state['coordinator']} (SO_REUSEPORT; pids "
              f"{', '.join(str(pid) for name, pid in state['pids'].items() if name.startswith('coordinator'))})",
              flush=True)
    print(f"pdserve listening on {state['coordinator']} (prefill: {', '.join(state['prefill'])}; "
          f"decode: {', '.join(state['decode'])})", flush=True)
    if coordinator.http_port is not None:
        print(f"OpenAI-compatible HTTP on http://{args.host}:{coordinator.http_port}/v1", flush=True)
    print("each process's own Prometheus metrics: " + ", ".join(f"{name} http://{address}/metrics"
                                                             for name, address in state["metrics"].items()), flush=True)
    if args.metrics_port:
        print(f"all of them, labelled engine and worker: http://{args.host}:{args.metrics_port}/metrics", flush=True)
    print(f"try: pdserve generate --addr {state['coordinator']} --prompt 'def main():'", flush=True)
    import signal
    import time

    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    supervisor = launcher.Supervisor(cluster)
    restarts = 0
    try:
        while not stopping:
            supervisor.poll()
            if args.state_file and sum(p.restarts for p in cluster.procs) != restarts:
                restarts = sum(p.restarts for p in cluster.procs)
                launcher.write_state(cluster, args.state_file)
            time.sleep(0.25)
    except KeyboardInterrupt:
        pass
    print("stopping ...", file=sys.stderr)
    cluster.stop()
    return 0


def cmd_coordinator(args) -> int:
    from pdserve.server import serving
    from pdserve.server.coordinator.config import CoordinatorConfig
    from pdserve.server.coordinator.main import serve
    from pdserve.server.security import resolve_api_key

    model = _resolve_model(args)
    _check_model(model, args.max_model_len)
    config = _config(CoordinatorConfig, args, model_dir=model, api_key=resolve_api_key(args.api_key),
                     metrics_port=args.metrics_port)
    _configure_tls(args)
    serving.run(lambda: serve(config))
    return 0


def cmd_prefill(args) -> int:
    from pdserve.server import serving
    from pdserve.server.prefill.config import PrefillConfig
    from pdserve.server.prefill.main import serve

    model = _resolve_model(args)
    _check_model(model, args.max_model_len)
    config = _config(PrefillConfig, args, model_dir=model, **_dtypes(args, kv_flag=None))
    options = _worker_options(args)
    serving.run(lambda: serve(config, options))
    return 0


def cmd_decode(args) -> int:
    from pdserve.server import serving
    from pdserve.server.decode.config import DecodeConfig
    from pdserve.server.decode.main import serve

    model = _resolve_model(args)
    _check_model(model, args.max_model_len)
    config = _config(DecodeConfig, args, model_dir=model, **_dtypes(args))
    options = _worker_options(args, kv_port=args.kv_port)
    serving.run(lambda: serve(config, options))
    return 0


def cmd_generate(args) -> int:
    from pdserve.server.client import build_request, run_generate

    try:
        ids = [int(t) for t in args.token_ids.split(",")] if args.token_ids else None
    except ValueError:
        raise SystemExit(f"pdserve generate: error: --token-ids must be comma-separated integers, "
                         f"got {args.token_ids!r}") from None
    request = build_request(prompt=args.prompt, token_ids=ids, max_tokens=args.max_tokens,
                            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            stop=args.stop or [], ignore_eos=args.ignore_eos)
    from pdserve.server.security import resolve_api_key

    return run_generate(args.addr, request, args.json, timeout=args.timeout, api_key=resolve_api_key(args.api_key),
                        tls=_client_tls(args))


def _client_tls(args):
    from pdserve.server.security import TlsConfig

    try:
        return TlsConfig(args.tls_cert, args.tls_key, args.tls_ca)
    except ValueError as e:
        raise SystemExit(f"pdserve: {e}")


def cmd_status(args) -> int:
    from pdserve.server.client import run_status
    from pdserve.server.security import resolve_cluster_secret

    return run_status(args.addr, args.json, _client_tls(args), resolve_cluster_secret(args.cluster_secret_file))


def cmd_make_tiny_model(args) -> int:
    from pdserve.server.model.tiny import make_tiny_model

    out = make_tiny_model(args.dir, args.family, dtype=args.dtype)
    print(f"wrote a random-weight tiny {args.family} checkpoint to {out}")
    return 0


def cmd_demo(args) -> int:
    from pdserve.server import launcher
    from pdserve.server.client import build_request, run_generate

    model = _resolve_model(args) or default_model_dir()
    _check_model(model)
    print("starting 1 prefill worker (JAX), 1 decode worker (torch) and the coordinator ...", file=sys.stderr)
    cluster = launcher.launch(model, prefill_workers=1, decode_workers=1, port=0, host="127.0.0.1")
    try:
        addr = cluster.coordinator.address
        print(f"\n$ pdserve generate --addr {addr} --prompt {args.prompt!r} --max-tokens {args.max_tokens}")
        code = run_generate(addr, build_request(prompt=args.prompt, max_tokens=args.max_tokens, temperature=0.0),
                            as_json=False, timeout=120)
    finally:
        cluster.stop()
    return code


COMMANDS = "pdserve.commands"
"""The entry-point group of the subcommands other packages give `pdserve`, each a `main(argv) -> int` that
parses its own flags, imported only when it runs (pyproject.toml: `pdserve bench`, the load generator in
benchmarks/): the server's processes never import them."""


def _added_commands(taken: set[str]) -> list:
    """The COMMANDS entry points, one per name, none shadowing pdserve's own."""
    from importlib.metadata import entry_points

    added: dict = {}
    for ep in entry_points(group=COMMANDS):
        if ep.name not in taken:
            added.setdefault(ep.name, ep)
    return list(added.values())


def cmd_added(args) -> int:
    return args.entry_point.load()(args.rest)


def cmd_plan(args) -> int:
    from pdserve.server.plan.cli import main as plan_main

    return plan_main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from pdserve.server.coordinator.config import CoordinatorConfig
    from pdserve.server.decode.config import DecodeConfig
    from pdserve.server.prefill.config import PrefillConfig

    p = sub.add_parser("up", help="start a coordinator and workers on this host (takes `vllm serve`'s flags)")
    _model_arg(p, required=False)
    p.add_argument("--prefill-workers", type=int, default=1)
    p.add_argument("--decode-workers", type=int, default=1)
    p.add_argument("--coordinators", type=int, default=1,
                   help="coordinator processes sharing the port (SO_REUSEPORT), each routing over every worker")
    _server_args(p, 50051)
    p.add_argument("--state-file", type=Path,
                   help="write the processes' addresses here as JSON (their own /metrics under \"metrics\")")
    p.add_argument("--cluster-secret-file", type=Path,
                   help="the internal links' secret (default: a fresh one, in a private temporary file)")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="serve here one /metrics with every process's series, each labelled engine (its index, "
                        "as vLLM's) and worker (its name), beside the supervisor's pdserve_worker_restarts_total "
                        "and pdserve_worker_up (0: off; each process's own port is in --state-file either way)")
    _vllm_dtype_args(p)
    g = p.add_argument_group("every tier")
    add_flags(g, CoordinatorConfig, only=UP_SHARED)
    add_flags(g, PrefillConfig, only=UP_WORKERS)
    g = p.add_argument_group("LoRA adapters (vLLM's flags; both worker tiers compute with them)")
    add_flags(g, CoordinatorConfig, only=UP_LORA_COORDINATOR)
    add_flags(g, DecodeConfig, only=tuple(f for f in UP_LORA_WORKERS if f not in UP_LORA_COORDINATOR))
    g = p.add_argument_group("the coordinator (its flags)")
    add_flags(g, CoordinatorConfig, only=UP_COORDINATOR)
    g = p.add_argument_group("the prefill workers (their flags)")
    add_flags(g, PrefillConfig, only=("weight_dtype",), prefix="prefill")
    add_flags(g, PrefillConfig, only=UP_PREFILL)
    g = p.add_argument_group("the decode workers (their flags)",
                             f"each runs on one device (`pdserve decode --engine vllm --tensor-parallel-size N` spans "
                             f"N); under --decode-engine vllm in blocks of {VLLM_BLOCK_SIZE} tokens")
    add_flags(g, DecodeConfig, only=("weight_dtype", "device", "engine"), prefix="decode")
    g.add_argument("--decode-python", help="the python that runs decode workers (default: this one); for "
                                           "--decode-engine vllm one with vLLM installed, e.g. .venv-vllm/bin/python")
    add_flags(g, DecodeConfig, only=UP_DECODE)
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("coordinator", help="run the coordinator (public API)")
    _model_arg(p)
    add_flags(p, CoordinatorConfig)
    _common_args(p)
    p.set_defaults(func=cmd_coordinator)

    p = sub.add_parser("prefill", help="run a prefill worker (JAX)")
    _model_arg(p)
    add_flags(p, PrefillConfig, defaults={"port": 50052})
    _vllm_dtype_args(p, kv=False)
    _worker_args(p)
    p.set_defaults(func=cmd_prefill)

    p = sub.add_parser("decode", help="run a decode worker (torch)")
    _model_arg(p)
    add_flags(p, DecodeConfig, defaults={"port": 50053})
    _vllm_dtype_args(p)
    _worker_args(p)
    p.add_argument("--kv-port", type=int, help="serve KvTransfer alone on this port (default: the main port)")
    p.set_defaults(func=cmd_decode)

    p = sub.add_parser("generate", help="stream one generation from a running server")
    p.add_argument("--addr", default="127.0.0.1:50051")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt")
    g.add_argument("--token-ids", help="comma-separated ids, e.g. 1,2,3")
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    _client_args(p)
    p.add_argument("--api-key", help="sent as 'authorization: Bearer KEY' (default $PDSERVE_API_KEY)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("status", help="print the coordinator's workers: role, state, load, KV usage")
    p.add_argument("--addr", default="127.0.0.1:50051", help="the coordinator")
    p.add_argument("--json", action="store_true", help="one JSON object per worker")
    _client_args(p)
    p.add_argument("--cluster-secret-file", type=Path, help="the cluster's secret (the pools are internal)")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("make-tiny-model", help="write a small random-weight HF checkpoint")
    p.add_argument("dir", type=Path)
    p.add_argument("--family", choices=list(TINY_FAMILIES), default="llama")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.set_defaults(func=cmd_make_tiny_model)

    p = sub.add_parser("demo", help="start a small cluster, stream one generation, stop")
    _model_arg(p, required=False)
    p.add_argument("--prompt", default="def fibonacci(n):")
    p.add_argument("--max-tokens", type=int, default=48)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("plan", add_help=False, help="profile the tiers, simulate a cluster, size the cheapest plans "
                                                    "(`pdserve plan --help`: its commands)")
    p.set_defaults(func=cmd_plan, takes_rest=True)  # its flags go to its own parsers (see main)

    for ep in _added_commands(set(sub.choices)):
        p = sub.add_parser(ep.name, add_help=False, help=f"{ep.value} (`pdserve {ep.name} --help`: its flags)")
        p.set_defaults(func=cmd_added, entry_point=ep, takes_rest=True)  # its flags: its own parser (main)
    return parser


def main(argv: list[str] | None = None) -> int:
    from pdserve.server.hardware import apply_cpu_cap

    try:  # before torch or JAX starts: oneDNN, ATen and XLA see the CPU pdserve chooses kernels for
        apply_cpu_cap()
    except ValueError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "takes_rest", False):
        args.rest = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    _setup_logging(getattr(args, "log_format", "text"))
    try:
        return args.func(args) or 0
    except (ValueError, OSError) as e:  # a bad argument or file: say which, without a traceback
        logging.getLogger("pdserve").debug("pdserve %s failed", args.command, exc_info=True)
        print(f"pdserve {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
