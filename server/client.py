"""`pdserve generate`: stream one generation from a running server to the terminal."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import grpc

from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import generation_pb2_grpc

FINISH_NAMES = {
    gen_pb.FINISH_REASON_STOP: "stop",
    gen_pb.FINISH_REASON_LENGTH: "length",
    gen_pb.FINISH_REASON_ABORT: "abort",
    gen_pb.FINISH_REASON_ERROR: "error",
}


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


def stream(addr: str, request: gen_pb.GenerateRequest, timeout: float | None = None) -> Iterator[gen_pb.GenerateResponse]:
    with grpc.insecure_channel(addr) as ch:
        yield from generation_pb2_grpc.GenerationStub(ch).Generate(request, timeout=timeout)


def run_generate(addr: str, request: gen_pb.GenerateRequest, as_json: bool, timeout: float | None = None) -> int:
    try:
        for msg in stream(addr, request, timeout):
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
