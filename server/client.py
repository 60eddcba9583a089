"""`pdserve generate`: stream one generation from a running server to the terminal."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import grpc

from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve.server.finish import FINISH_NAMES
from pdserve.server.security import TlsConfig


def build_request(*, prompt: str | None = None, token_ids: list[int] | None = None, max_tokens: int | None = None,
                  temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                  seed: int | None = None, stop: list[str] = (), stop_token_ids: list[int] = (),
                  ignore_eos: bool = False, request_id: str = "") -> gen_pb.GenerateRequest:
    sampling = gen_pb.SamplingParams(stop=list(stop), stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos)
    for name, value in (("max_tokens", max_tokens), ("temperature", temperature), ("top_p", top_p),
                        ("top_k", top_k), ("seed", seed)):
        if value is not None:
            setattr(sampling, name, value)
    req = gen_pb.GenerateRequest(request_id=request_id, sampling=sampling)
    if token_ids is not None:
        req.token_ids.ids.extend(token_ids)
    else:
        req.text = prompt or ""
    return req


def open_channel(addr: str, tls: TlsConfig | None = None) -> grpc.Channel:
    """A blocking channel to a pdserve server; TLS (with a client certificate for mTLS) when `tls` says so."""
    if tls is not None and tls.enabled:
        return grpc.secure_channel(addr, tls.channel_credentials())
    return grpc.insecure_channel(addr)


def auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def stream(addr: str, request: gen_pb.GenerateRequest, timeout: float | None = None, *,
           api_key: str | None = None, tls: TlsConfig | None = None) -> Iterator[gen_pb.GenerateResponse]:
    with open_channel(addr, tls) as ch:
        yield from generation_pb2_grpc.GenerationStub(ch).Generate(request, timeout=timeout,
                                                                    metadata=auth_metadata(api_key))


def run_generate(addr: str, request: gen_pb.GenerateRequest, as_json: bool, timeout: float | None = None, *,
                 api_key: str | None = None, tls: TlsConfig | None = None) -> int:
    try:
        for msg in stream(addr, request, timeout, api_key=api_key, tls=tls):
            if as_json:
                line = {"token_ids": list(msg.token_ids), "text": msg.text}
                if msg.finish_reason:
                    line["finish_reason"] = FINISH_NAMES[msg.finish_reason]
                    line["usage"] = {"prompt_tokens": msg.usage.prompt_tokens,
                                     "completion_tokens": msg.usage.completion_tokens}
                print(json.dumps(line), flush=True)
            else:
                sys.stdout.write(msg.text)
                sys.stdout.flush()
                if msg.finish_reason:
                    sys.stdout.write(f"\n[finish_reason={FINISH_NAMES[msg.finish_reason]}, "
                                     f"prompt_tokens={msg.usage.prompt_tokens}, "
                                     f"completion_tokens={msg.usage.completion_tokens}]\n")
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            print(f"is pdserve running at {addr}? start it with `pdserve up`", file=sys.stderr)
        return 1
    return 0


def list_workers(addr: str, tls: TlsConfig | None = None, timeout: float = 10.0,
                 cluster_secret: str | None = None) -> list[worker_pb2.WorkerStatus]:
    """The coordinator's pools (an internal call: the cluster secret, or an operator certificate under mTLS)."""
    from pdserve.server.security import CLUSTER_SECRET_HEADER

    metadata = ((CLUSTER_SECRET_HEADER, cluster_secret),) if cluster_secret else ()
    with open_channel(addr, tls) as ch:
        reply = worker_pb2_grpc.RegistryStub(ch).ListWorkers(worker_pb2.ListWorkersRequest(), timeout=timeout,
                                                             metadata=metadata)
    return list(reply.workers)


def format_status(workers: list[worker_pb2.WorkerStatus]) -> str:
    """One line per worker: role, address, state, load, KV usage."""
    header = f"{'ROLE':<8} {'ADDRESS':<22} {'STATE':<9} {'JOINED':<10} {'INFLIGHT':>8} {'RUNNING':>7} " \
             f"{'WAITING':>7} {'QUEUED_TOK':>10} {'KV_USED':>13} {'KV_USAGE':>8} HARDWARE"
    lines = [header]
    for w in workers:
        load = w.info.load
        used = load.total_kv_blocks - load.free_kv_blocks
        kv = f"{used}/{load.total_kv_blocks}" if w.role == "decode" else "-"
        usage = f"{used / load.total_kv_blocks:.1%}" if w.role == "decode" and load.total_kv_blocks else "-"
        queued = str(load.queued_prefill_tokens) if w.role == "prefill" else "-"
        lines.append(f"{w.role:<8} {w.address:<22} {w.state:<9} {'register' if w.registered else 'flag':<10} "
                     f"{w.inflight:>8} {load.running_requests:>7} {load.waiting_requests:>7} {queued:>10} "
                     f"{kv:>13} {usage:>8} {_hardware(w.info.hardware)}")
    if not workers:
        lines.append("(no workers)")
    return "\n".join(lines)


def _hardware(hw: worker_pb2.Hardware) -> str:
    """The status line's hardware column: CPU family, device, and the matmul path chosen (`--json`: all)."""
    if not hw.cpu_family:
        return "-"  # an older worker
    chosen = hw.paths.get("matmuls") or hw.paths.get("compute") or ""
    return f"{hw.cpu_family}{' (capped)' if hw.cpu_cap else ''} {hw.devices}" + (f"; {chosen}" if chosen else "")


def run_status(addr: str, as_json: bool = False, tls: TlsConfig | None = None,
               cluster_secret: str | None = None) -> int:
    try:
        workers = list_workers(addr, tls, cluster_secret=cluster_secret)
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    if as_json:
        from google.protobuf.json_format import MessageToDict

        for w in workers:
            print(json.dumps(MessageToDict(w, preserving_proto_field_name=True)), flush=True)
    else:
        print(format_status(workers), flush=True)
    return 0
