"""The `pdserve` command: one subcommand per process role, plus `up`, `generate` and helpers."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from pdserve.server.cache_dir import cache_dir
from pdserve.server.flags import add_flags, config_from_args
from pdserve.server.vocabulary import (DECODE_ENGINES, KV_DTYPES, LOG_FORMATS, VLLM_DTYPES, VLLM_KV_CACHE_DTYPES,
                                       VLLM_QUANTIZATIONS, WEIGHT_DTYPES, translate)

DEFAULT_FAMILY = "llama"


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


def cmd_up(args) -> int:
    from pdserve.server import launcher

    if args.coordinators < 1:
        raise SystemExit(f"pdserve up: error: --coordinators must be >= 1, got {args.coordinators}")
    if args.prefill_workers < 0 or args.decode_workers < 1:
        raise SystemExit(f"pdserve up: error: --prefill-workers must be >= 0 and --decode-workers >= 1, got "
                         f"{args.prefill_workers} and {args.decode_workers}")
    if not args.stall_timeout > 0:
        raise SystemExit(f"pdserve up: error: --stall-timeout must be > 0, got {args.stall_timeout}")
    try:
        from pdserve.server.decode.device import parse_bytes, parse_device

        parse_device(args.decode_device)
        parse_bytes(args.kv_cache_memory, "--kv-cache-memory")
    except ValueError as e:
        raise SystemExit(f"pdserve up: error: {str(e).replace('--device', '--decode-device')}") from e
    model = _resolve_model(args) or default_model_dir()
    _preflight(args, model)
    print(f"starting {args.prefill_workers} prefill and {args.decode_workers} decode workers ...", file=sys.stderr)
    http_port = launcher.free_port(args.host) if args.http_port == 0 else args.http_port
    shared = [*(["--served-model-name", *args.served_model_name] if args.served_model_name else []),
              *(["--max-model-len", str(args.max_model_len)] if args.max_model_len else [])]
    coordinator_args = [*shared, *(["--http-port", str(http_port)] if http_port is not None else []),
                        *(["--chat-template", args.chat_template] if args.chat_template else []),
                        "--stall-timeout", str(args.stall_timeout), "--ttft-budget", str(args.ttft_budget)]
    secret_dir = None
    if args.cluster_secret_file is None:  # one fresh secret for this cluster's internal links
        import tempfile

        from pdserve.server.security import write_cluster_secret

        secret_dir = Path(tempfile.mkdtemp(prefix="pdserve-up-"))
        args.cluster_secret_file = write_cluster_secret(secret_dir / "cluster-secret")
    try:
        return _up(args, model, http_port, coordinator_args, shared)
    finally:
        if secret_dir is not None:
            import shutil

            shutil.rmtree(secret_dir, ignore_errors=True)


def _preflight(args, model: Path) -> None:
    """Refuses, before any process starts, what would fail one after others had (server/preflight.py)."""
    from pdserve.server import preflight

    config = preflight.check_model(model, args.max_model_len)
    if args.prefill_workers:
        preflight.check_prefill_tier(config, _dtypes(args, "prefill_weight_dtype", None)["prefill_weight_dtype"])
    preflight.check_decode_tier(args.decode_engine, args.decode_python or sys.executable, args.decode_device)


def _up(args, model: Path, http_port: int | None, coordinator_args: list[str], shared: list[str]) -> int:
    from pdserve.server import launcher

    if args.metrics_port:
        from pdserve.server import metrics

        metrics.identify(args.served_model_name[0] if args.served_model_name else model.resolve().name, "supervisor")
        metrics.serve_metrics(args.metrics_port, args.host)
    prefill = _dtypes(args, "prefill_weight_dtype", None)
    decode = _dtypes(args, "decode_weight_dtype", "kv_dtype")
    prefill_args = [*shared, "--weight-dtype", prefill["prefill_weight_dtype"],
                    *(["--tensor-parallel-size", str(args.tensor_parallel_size)] if args.tensor_parallel_size else []),
                    *(["--compilation-cache", str(args.compilation_cache)] if args.compilation_cache else []),
                    "--kv-streams", str(args.kv_streams), "--prefill-order", args.prefill_order,
                    "--max-num-batched-tokens", str(args.max_batch_tokens), "--prefix-cache-bytes", str(args.prefix_cache_bytes),
                    *(["--max-prefill-chunk", str(args.max_prefill_chunk)] if args.max_prefill_chunk else [])]
    decode_args = [*shared, "--weight-dtype", decode["decode_weight_dtype"], "--kv-dtype", decode["kv_dtype"],
                   *(["--max-running", str(args.max_running)] if args.max_running else []),
                   *(["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
                     if args.gpu_memory_utilization is not None else []),
                   "--device", args.decode_device, "--kv-cache-memory", args.kv_cache_memory,
                   "--cpu-matmul", args.cpu_matmul,
                   *(["--enforce-eager"] if args.enforce_eager else []),
                   # vLLM's CPU attention takes blocks of 32 tokens (and CUDA backends multiples of 16).
                   *(["--engine", "vllm", "--block-size", "32"] if args.decode_engine == "vllm" else [])]
    try:
        cluster = launcher.launch(model, prefill_workers=args.prefill_workers, decode_workers=args.decode_workers,
                                  port=args.port, host=args.host, coordinator_args=coordinator_args,
                                  common_args=["--cluster-secret-file", str(args.cluster_secret_file)],
                                  prefill_args=prefill_args, decode_args=decode_args,
                                  decode_python=args.decode_python or sys.executable,
                                  coordinators=args.coordinators)
    except (RuntimeError, TimeoutError) as e:
        print(f"pdserve up failed: {e}", file=sys.stderr)
        return 1
    state = cluster.describe()
    if args.state_file:
        launcher.write_state(cluster, args.state_file)
    if args.coordinators > 1:
        print(f"{args.coordinators} coordinator processes share {state['coordinator']} (SO_REUSEPORT; pids "
              f"{', '.join(str(pid) for name, pid in state['pids'].items() if name.startswith('coordinator'))})",
              flush=True)
    print(f"pdserve listening on {state['coordinator']} (prefill: {', '.join(state['prefill'])}; "
          f"decode: {', '.join(state['decode'])})", flush=True)
    if http_port is not None:
        print(f"OpenAI-compatible HTTP on http://{args.host}:{http_port}/v1", flush=True)
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


def cmd_bench(args) -> int:
    """The load generator parses its own flags: the server's processes never import benchmarks/."""
    from pdserve.benchmarks.bench import build_parser as bench_parser
    from pdserve.benchmarks.bench import run_cli

    return run_cli(bench_parser().parse_args(args.bench_args))


def _field_names(cls) -> list[str]:
    import dataclasses

    return [f.name for f in dataclasses.fields(cls)]


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
    p.add_argument("--state-file", type=Path, help="write the processes' addresses here as JSON")
    p.add_argument("--http-port", type=int, help="serve the OpenAI-compatible HTTP API on this port (0: a free one)")
    p.add_argument("--prefill-weight-dtype", choices=WEIGHT_DTYPES, default="auto", help="prefill workers' weights")
    p.add_argument("--decode-weight-dtype", choices=WEIGHT_DTYPES, default="auto", help="decode workers' weights")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="auto", help="decode workers' KV cache (and the wire)")
    _vllm_dtype_args(p)
    add_flags(p, CoordinatorConfig, skip=tuple(f for f in _field_names(CoordinatorConfig)
                                               if f not in ("served_model_name", "max_model_len", "chat_template",
                                                             "ttft_budget")))
    add_flags(p, DecodeConfig, skip=tuple(f for f in _field_names(DecodeConfig)
                                          if f not in ("gpu_memory_utilization", "enforce_eager", "kv_cache_memory",
                                                        "cpu_matmul")))
    p.add_argument("--decode-device", default="auto",
                   help="decode workers' device (their --device): auto (CUDA when torch sees one), cpu, cuda, cuda:N")
    add_flags(p, PrefillConfig, skip=tuple(f for f in _field_names(PrefillConfig)
                                           if f not in ("kv_streams", "prefill_order", "compilation_cache", "max_batch_tokens",
                                                        "max_prefill_chunk", "prefix_cache_bytes")))
    p.add_argument("--tensor-parallel-size", type=int,
                   help="prefill workers shard the model over this many devices (default: all of them); "
                        "each decode worker runs on one device (`pdserve decode --engine vllm "
                        "--tensor-parallel-size N` spans N)")
    p.add_argument("--max-running", "--max-num-seqs", dest="max_running", type=int,
                   help="each decode worker's running-request cap (default: the decode worker's)")
    p.add_argument("--decode-engine", choices=DECODE_ENGINES, default="native",
                   help="decode workers' engine: pdserve's torch engine or vLLM's (through pdserve's KV connector)")
    p.add_argument("--decode-python", help="the python that runs decode workers (default: this one); for "
                                           "--decode-engine vllm one with vLLM installed, e.g. .venv-vllm/bin/python")
    p.add_argument("--cluster-secret-file", type=Path,
                   help="the internal links' secret (default: a fresh one, in a private temporary file)")
    p.add_argument("--stall-timeout", type=float, default=10.0,
                   help="the coordinator migrates a stream whose decode worker sends nothing this long (s) "
                        "after its first token")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="serve this supervisor's /metrics (pdserve_worker_restarts_total) here (0: off)")
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
    p.add_argument("--family", choices=["llama", "mistral", "qwen2", "qwen3"], default="llama")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.set_defaults(func=cmd_make_tiny_model)

    p = sub.add_parser("demo", help="start a small cluster, stream one generation, stop")
    _model_arg(p, required=False)
    p.add_argument("--prompt", default="def fibonacci(n):")
    p.add_argument("--max-tokens", type=int, default=48)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("bench", help="load-test a pdserve (gRPC) or OpenAI-compatible server "
                                     "(`pdserve bench --help`: its flags)", add_help=False,
                       description="Load generator: see benchmarks/bench.py and benchmarks/README.md")
    p.set_defaults(func=cmd_bench)  # its flags go to benchmarks/bench.py's own parser (see main)
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
    if args.command == "bench":
        args.bench_args = rest
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
