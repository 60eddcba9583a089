"""The hostile harness's request families, each a list of `Case`s spread over the public ports (the OpenAI
HTTP front, pdserve.v1.Generation, KServe v2 gRPC) and the internal ones (the workers' services and the
coordinator's Registry, called without the cluster credential).

Every case is bad input: the only right answers are a client error or, where the request is legal after
all (a big but valid tool list), serving it. `families(targets)` builds every case's bytes once.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

from pdserve.benchmarks.hostile import payloads as hp
from pdserve.benchmarks.hostile.send import Outcome, Ports
from pdserve.server.security import CLUSTER_SECRET_HEADER
from pdserve.v1 import generation_pb2 as gen_pb
from tritonclient.grpc import service_pb2

Port = Literal["openai", "grpc", "kserve", "internal"]
GENERATE = "/pdserve.v1.Generation/Generate"
INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"
HEALTH = "/grpc.health.v1.Health/Check"
MAX_TOKENS = 4
"""What a case that is served after all may generate: the harness is about refusals, not decoding."""


@dataclass(frozen=True)
class Targets:
    grpc: str
    """The coordinator: Generation, KServe and the Registry."""
    http: str
    model: str
    """The served model name (`model` in OpenAI bodies, `model_name` in KServe)."""
    prefill: tuple[str, ...]
    decode: tuple[str, ...]


@dataclass(frozen=True)
class Case:
    family: str
    port: Port
    name: str
    send: Callable[[Ports], Outcome]


# --- request builders ------------------------------------------------------------------------------

def _completion(t: Targets, **fields: Any) -> dict[str, Any]:
    return {"model": t.model, "prompt": "def main():", "max_tokens": MAX_TOKENS, **fields}


def _chat(t: Targets, **fields: Any) -> dict[str, Any]:
    return {"model": t.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": MAX_TOKENS, **fields}


def _generate(text: str = "def main():", **sampling: Any) -> bytes:
    structured = sampling.pop("structured", None)
    params = gen_pb.SamplingParams(**{"max_tokens": MAX_TOKENS, **sampling})
    if structured is not None:
        params.structured.CopyFrom(gen_pb.StructuredOutput(**structured))
    return gen_pb.GenerateRequest(text=text, sampling=params).SerializeToString()


def _tensor(values: list[bytes]) -> bytes:
    """Triton's BYTES wire format: each element a little-endian uint32 length, then its bytes."""
    return b"".join(struct.pack("<I", len(v)) + v for v in values)


def _infer(t: Targets, prompt: bytes = b"def main():", sampling: str | bytes | None = '{"max_tokens": 4}',
           stream: bool = False, model: str | None = None, **parameters: Any) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=t.model if model is None else model)
    inputs = [("text_input", "BYTES", _tensor([prompt]))]
    if sampling is not None:
        raw = sampling.encode("utf-8", "surrogatepass") if isinstance(sampling, str) else sampling
        inputs.append(("sampling_parameters", "BYTES", _tensor([raw])))
    if stream:
        inputs.append(("stream", "BOOL", b"\x01"))
    for name, datatype, raw in inputs:
        request.inputs.add(name=name, datatype=datatype, shape=[1])
        request.raw_input_contents.append(raw)
    for key, value in parameters.items():
        param = request.parameters[key]
        if isinstance(value, bool):
            param.bool_param = value
        elif isinstance(value, int):
            param.int64_param = value
        elif isinstance(value, float):
            param.double_param = value
        else:
            param.string_param = value
    return request


# --- case constructors per port --------------------------------------------------------------------

def _http(family: str, name: str, path: str, body: str | bytes, content_type: str = "application/json") -> Case:
    return Case(family, "openai", name, lambda p: p.post(path, body, content_type))


def _grpc(family: str, name: str, t: Targets, request: bytes, method: str = GENERATE,
          streaming: bool = True) -> Case:
    return Case(family, "grpc", name, lambda p: p.call(t.grpc, method, request, streaming=streaming))


def _kserve(family: str, name: str, t: Targets, request: service_pb2.ModelInferRequest | bytes) -> list[Case]:
    """The request as a ModelInfer call and as one message of a ModelStreamInfer stream."""
    raw = request if isinstance(request, bytes) else request.SerializeToString()
    return [Case(family, "kserve", f"{name} (ModelInfer)", lambda p: p.call(t.grpc, INFER, raw)),
            Case(family, "kserve", f"{name} (ModelStreamInfer)",
                 lambda p: p.call_stream(t.grpc, STREAM_INFER, [raw], kserve=True))]


def _structured_everywhere(family: str, name: str, t: Targets, kind: str, spec: Any) -> list[Case]:
    """One structured-output spec on every front: OpenAI `structured_outputs` (completions) and, for
    json schemas, `response_format` (chat); Generation's `structured`; KServe's `structured_outputs`."""
    vllm_key = {"json_schema": "json", "grammar": "grammar", "regex": "regex", "choice": "choice"}[kind]
    raw_spec = spec if kind == "json_schema" else json.dumps(spec)
    cases = [_http(family, f"{name} (completions)", "/v1/completions",
                   hp.embed(_completion(t, structured_outputs={vllm_key: hp.RAW}), raw_spec))]
    if kind == "json_schema":
        cases.append(_http(family, f"{name} (chat response_format)", "/v1/chat/completions", hp.embed(
            _chat(t, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": hp.RAW}}),
            raw_spec)))
    grpc_spec = {"choice": gen_pb.Choices(choices=spec)} if kind == "choice" else {kind: spec}
    cases.append(_grpc(family, name, t, _generate(structured=grpc_spec)))
    sampling = hp.embed({"max_tokens": MAX_TOKENS, "structured_outputs": {vllm_key: hp.RAW}}, raw_spec)
    return cases + _kserve(family, name, t, _infer(t, sampling=sampling))


# --- the families ----------------------------------------------------------------------------------

def _schemas(t: Targets) -> list[Case]:
    return [c for name, build in hp.SCHEMAS.items()
            for c in _structured_everywhere("schemas", name, t, "json_schema", build())]


def _grammar_bombs(t: Targets) -> list[Case]:
    cases = [c for name, build in hp.GRAMMARS.items()
             for c in _structured_everywhere("grammar_bombs", name, t, "grammar", build())]
    cases += [c for name, regex in hp.REGEXES.items()
              for c in _structured_everywhere("grammar_bombs", f"regex {name}", t, "regex", regex)]
    return cases + _structured_everywhere("grammar_bombs", "20,000 choices", t, "choice", hp.choices())


def _huge_tools(t: Targets) -> list[Case]:
    tools = hp.tool_list()
    deep_params = '{"type":"object","properties":{"a":' * 2_000 + '{"type":"string"}' + "}}" * 2_000
    one_tool = [{"type": "function", "function": {"name": "f", "parameters": hp.RAW}}]
    return [
        _http("huge_tools", "1,000 tools, tool_choice required", "/v1/chat/completions",
              json.dumps(_chat(t, tools=tools, tool_choice="required"))),
        _http("huge_tools", "1,000 tools, a named tool", "/v1/chat/completions",
              json.dumps(_chat(t, tools=tools, tool_choice={"type": "function", "function": {"name": "tool_999"}}))),
        _http("huge_tools", "1,000 tools, auto", "/v1/chat/completions", json.dumps(_chat(t, tools=tools))),
        _http("huge_tools", "a tool whose parameters are 700 chained $defs", "/v1/chat/completions",
              hp.embed(_chat(t, tools=one_tool, tool_choice="required"), hp.chained_defs())),
        _http("huge_tools", "a tool whose parameters nest 2,000 deep", "/v1/chat/completions",
              hp.embed(_chat(t, tools=one_tool, tool_choice="required"), deep_params)),
        _http("huge_tools", "20,000 tools", "/v1/chat/completions",
              json.dumps(_chat(t, tools=hp.tool_list(20_000, 1), tool_choice="required"))),
    ]


def _deep_json(t: Targets) -> list[Case]:
    deep_args = json.dumps(hp.deep_object(5_000))  # the arguments string of an earlier tool call
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "f", "arguments": hp.RAW}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    cases = [
        _http("deep_json", "a body 100,000 deep", "/v1/completions", hp.deep_array(100_000)),
        _http("deep_json", "an unknown field 10,000 deep", "/v1/completions",
              hp.embed(_completion(t, extra=hp.RAW), hp.deep_object(10_000))),
        _http("deep_json", "content parts 10,000 deep", "/v1/chat/completions",
              hp.embed({"model": t.model, "messages": [{"role": "user", "content": hp.RAW}]}, hp.deep_array(10_000))),
        _http("deep_json", "tool-call arguments 5,000 deep", "/v1/chat/completions",
              hp.embed({"model": t.model, "max_tokens": MAX_TOKENS, "messages": history}, deep_args)),
        _http("deep_json", "chat_template_kwargs 10,000 deep", "/v1/chat/completions",
              hp.embed(_chat(t, chat_template_kwargs={"x": hp.RAW}), hp.deep_object(10_000))),
        _http("deep_json", "a message 10,000 deep", "/v1/chat/completions",
              hp.embed({"model": t.model, "messages": [{"role": "user", "content": "hi", "x": hp.RAW}]},
                       hp.deep_object(10_000))),
        _http("deep_json", "/tokenize messages 10,000 deep", "/tokenize",
              hp.embed({"model": t.model, "messages": [{"role": "user", "content": hp.RAW}]}, hp.deep_array(10_000))),
        _http("deep_json", "20,000 messages", "/v1/chat/completions",
              json.dumps(_chat(t, messages=[{"role": "user", "content": "hi"}] * 20_000))),
        _http("deep_json", "logit_bias of 100,000 keys", "/v1/completions",
              json.dumps(_completion(t, logit_bias={str(i): 1.0 for i in range(100_000)}))),
        _grpc("deep_json", "100,000 stop strings", t, _generate(stop=["s"] * 100_000)),
        _grpc("deep_json", "a 10,000-deep json_schema string", t, _generate(structured={"json_schema": hp.deep_array(10_000)})),
    ]
    cases += _kserve("deep_json", "sampling_parameters 10,000 deep", t,
                     _infer(t, sampling='{"max_tokens": 4, "x": ' + hp.deep_object(10_000) + "}"))
    cases += _kserve("deep_json", "structured_outputs json 10,000 deep", t,
                     _infer(t, sampling='{"max_tokens": 4, "structured_outputs": {"json": ' + hp.deep_array(10_000) + "}}"))
    return cases


def _bad_utf8(t: Targets) -> list[Case]:
    s = hp.LONE  # a lone surrogate once written as a JSON escape: valid JSON, no valid string
    one_tool = [{"type": "function", "function": {"name": s, "parameters": {}}}]
    lone = {"completion prompt": ("/v1/completions", _completion(t, prompt=f"a{s}b")),
            "chat content": ("/v1/chat/completions", _chat(t, messages=[{"role": "user", "content": s}])),
            "stop": ("/v1/completions", _completion(t, stop=[s])),
            "model": ("/v1/completions", _completion(t, model=s)),
            "tokenize prompt": ("/tokenize", {"model": t.model, "prompt": s}),
            "tokenize messages": ("/tokenize", {"model": t.model, "messages": [{"role": "user", "content": s}]}),
            "user": ("/v1/completions", _completion(t, user=s)),
            "role": ("/v1/chat/completions", _chat(t, messages=[{"role": s, "content": "x"}])),
            "tool name": ("/v1/chat/completions", _chat(t, tools=one_tool, tool_choice="required")),
            "schema key": ("/v1/completions", _completion(t, structured_outputs={
                "json": {"type": "object", "properties": {s: {"type": "string"}}}})),
            "regex": ("/v1/completions", _completion(t, structured_outputs={"regex": s})),
            "choice": ("/v1/completions", _completion(t, structured_outputs={"choice": [s, "b"]})),
            "logit_bias key": ("/v1/completions", _completion(t, logit_bias={s: 1})),
            "a field name": ("/v1/completions", _completion(t, **{s: 1}))}
    lone = {where: (path, hp.lone_surrogates(body)) for where, (path, body) in lone.items()}
    cases = [_http("bad_utf8", f"lone surrogate in {where}", path, body) for where, (path, body) in lone.items()]
    raw_body = json.dumps(_completion(t, prompt=hp.BAD)).encode().replace(hp.BAD.encode(), hp.INVALID_UTF8)
    cases.append(_http("bad_utf8", "invalid UTF-8 bytes in the body", "/v1/completions", raw_body))
    cases.append(_http("bad_utf8", "invalid UTF-8 in a chat body", "/v1/chat/completions",
                       json.dumps(_chat(t, messages=[{"role": "user", "content": hp.BAD}])).encode()
                       .replace(hp.BAD.encode(), hp.INVALID_UTF8)))
    for where, request in {
        "text": _generate(text=hp.BAD),
        "request_id": gen_pb.GenerateRequest(request_id=hp.BAD, text="x",
                                             sampling=gen_pb.SamplingParams(max_tokens=4)).SerializeToString(),
        "stop": _generate(stop=[hp.BAD]),
        "json_schema": _generate(structured={"json_schema": '{"enum": ["' + hp.BAD + '"]}'}),
        "regex": _generate(structured={"regex": hp.BAD}),
        "grammar": _generate(structured={"grammar": 'start: "' + hp.BAD + '"'}),
        "choice": _generate(structured={"choice": gen_pb.Choices(choices=[hp.BAD, "b"])}),
    }.items():
        cases.append(_grpc("bad_utf8", f"invalid UTF-8 in {where}", t, hp.bad_bytes(request)))
    cases += _kserve("bad_utf8", "invalid UTF-8 text_input", t, _infer(t, prompt=hp.INVALID_UTF8))
    cases += _kserve("bad_utf8", "lone surrogate in sampling_parameters stop", t,
                     _infer(t, sampling='{"max_tokens": 4, "stop": ["\\ud800"]}'))
    cases += _kserve("bad_utf8", "invalid UTF-8 in sampling_parameters", t, _infer(t, sampling=b'{"stop": ["\xff"]}'))
    with_id = _infer(t)
    with_id.id = hp.BAD
    cases += _kserve("bad_utf8", "invalid UTF-8 in the request id", t, hp.bad_bytes(with_id.SerializeToString()))
    cases += _kserve("bad_utf8", "invalid UTF-8 in the model name", t, hp.bad_bytes(_infer(t, model=hp.BAD).SerializeToString()))
    cases += _kserve("bad_utf8", "invalid UTF-8 in a string parameter", t,
                     hp.bad_bytes(_infer(t, stop=hp.BAD).SerializeToString()))
    return cases


def _big_ints(t: Targets) -> list[Case]:
    huge, over = 2**64 + 5, 2**63
    http = {
        "prompt ids past int64": ("/v1/completions", _completion(t, prompt=[1, huge])),
        "prompt ids at 2**63": ("/v1/completions", _completion(t, prompt=[over])),
        "negative prompt id past int64": ("/v1/completions", _completion(t, prompt=[-over - 1])),
        "echo with ids past int64": ("/v1/completions", _completion(t, prompt=[huge], echo=True)),
        "batched prompt ids past int64": ("/v1/completions", _completion(t, prompt=[[1], [huge]])),
        "stop_token_ids past int64": ("/v1/completions", _completion(t, stop_token_ids=[huge])),
        "seed past uint64": ("/v1/completions", _completion(t, seed=2**70)),
        "max_tokens 10**30": ("/v1/completions", _completion(t, max_tokens=10**30)),
        "top_k 2**63": ("/v1/completions", _completion(t, top_k=over)),
        "logprobs 2**40": ("/v1/completions", _completion(t, logprobs=2**40)),
        "min_tokens 2**63": ("/v1/completions", _completion(t, min_tokens=over)),
        "logit_bias key past int64": ("/v1/completions", _completion(t, logit_bias={str(huge): 1})),
        "n 2**63": ("/v1/completions", _completion(t, n=over)),
        "chat top_logprobs 2**63": ("/v1/chat/completions", _chat(t, logprobs=True, top_logprobs=over)),
        "chat max_completion_tokens 10**30": ("/v1/chat/completions", _chat(t, max_completion_tokens=10**30)),
        "detokenize ids past int64": ("/detokenize", {"model": t.model, "tokens": [huge]}),
        "detokenize negative ids": ("/detokenize", {"model": t.model, "tokens": [-1]}),
    }
    cases = [_http("big_ints", name, path, json.dumps(body)) for name, (path, body) in http.items()]
    ids = lambda values: gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=values),
                                                sampling=gen_pb.SamplingParams(max_tokens=4)).SerializeToString()
    for name, request in {"token id -1": ids([-1]), "token id 2**62": ids([2**62]), "token id -2**63": ids([-over]),
                          "stop_token_ids 2**62": _generate(stop_token_ids=[2**62, -over]),
                          "max_tokens 2**31-1": _generate(max_tokens=2**31 - 1),
                          "logprobs 2**32-1": _generate(logprobs=2**32 - 1),
                          "prompt_logprobs 2**32-1": _generate(prompt_logprobs=2**32 - 1),
                          "min_tokens 2**32-1": _generate(min_tokens=2**32 - 1),
                          "top_k -5": _generate(top_k=-5)}.items():
        cases.append(_grpc("big_ints", name, t, request))
    for name, sampling in {"stop_token_ids past int64": {"stop_token_ids": [huge]}, "seed 2**70": {"seed": 2**70},
                           "max_tokens 10**30": {"max_tokens": 10**30}, "top_k -2**70": {"top_k": -(2**70)},
                           "logprobs 2**40": {"logprobs": 2**40}}.items():
        cases += _kserve("big_ints", name, t, _infer(t, sampling=json.dumps(sampling)))
    cases += _kserve("big_ints", "a max_tokens parameter of 2**62", t, _infer(t, sampling=None, max_tokens=2**62))
    cases += _kserve("big_ints", "a negative timeout parameter", t, _infer(t, timeout=-(2**63)))
    return cases


def _nan_inf(t: Targets) -> list[Case]:
    body = json.dumps(_completion(t, temperature=hp.RAW))
    http = [("temperature NaN", body.replace(f'"{hp.RAW}"', "NaN")),
            ("temperature Infinity", body.replace(f'"{hp.RAW}"', "Infinity")),
            ("temperature 1e999", body.replace(f'"{hp.RAW}"', "1e999")),
            ("top_p NaN", json.dumps(_completion(t, top_p=float("nan")))),
            ("presence_penalty -Infinity", json.dumps(_completion(t, presence_penalty=float("-inf")))),
            ("repetition_penalty NaN", json.dumps(_completion(t, repetition_penalty=float("nan")))),
            ("min_p Infinity", json.dumps(_completion(t, min_p=float("inf")))),
            ("logit_bias NaN", json.dumps(_completion(t, logit_bias={"5": float("nan")}))),
            ("chat temperature -Infinity", json.dumps(_chat(t, temperature=float("-inf"))))]
    cases = [_http("nan_inf", name, "/v1/completions" if not name.startswith("chat") else "/v1/chat/completions", b)
             for name, b in http]
    nan, inf = float("nan"), float("inf")
    for name, sampling in {"temperature NaN": {"temperature": nan}, "top_p inf": {"top_p": inf},
                           "min_p NaN": {"min_p": nan}, "repetition_penalty -inf": {"repetition_penalty": -inf},
                           "presence_penalty NaN": {"presence_penalty": nan},
                           "frequency_penalty inf": {"frequency_penalty": inf}}.items():
        cases.append(_grpc("nan_inf", name, t, _generate(**sampling)))
        cases += _kserve("nan_inf", f"sampling_parameters {name}", t, _infer(t, sampling=json.dumps(sampling)))
    cases += _kserve("nan_inf", "a temperature parameter of NaN", t, _infer(t, sampling=None, temperature=nan))
    return cases


@cache
def _blob(size: int) -> bytes:
    return bytes(size)


def _oversized(t: Targets) -> list[Case]:
    chunk = b"x" * 2**20
    big_prompt = "x" * (5 * 2**20)
    path = "/v1/completions"
    over_64 = 64 * 2**20 + 1024  # past the gRPC servers' 64 MiB message limit
    cases = [
        Case("oversized", "openai", "Content-Length 10**12, 64 KB sent", lambda p: p.post_raw(
            path, {"content-type": "application/json", "content-length": str(10**12)}, [b"{" * 65536])),
        Case("oversized", "openai", "Content-Length 12 MB, sent whole", lambda p: p.post_raw(
            path, {"content-type": "application/json", "content-length": str(12 * 2**20)}, [chunk] * 12)),
        Case("oversized", "openai", "chunked, 12 MB", lambda p: p.post_raw(
            path, {"content-type": "application/json", "transfer-encoding": "chunked"},
            [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * 12 + [b"0\r\n\r\n"])),
        Case("oversized", "openai", "Content-Length not a number", lambda p: p.post_raw(
            path, {"content-type": "application/json", "content-length": "12abc"}, [b"{}"])),
        _http("oversized", "a 5 MB prompt", path, json.dumps(_completion(t, prompt=big_prompt))),
        _grpc("oversized", "a 5 MB text prompt", t, _generate(text=big_prompt)),
        _grpc("oversized", "a 2,000,000-token prompt", t, gen_pb.GenerateRequest(
            token_ids=gen_pb.TokenIds(ids=[5] * 2_000_000), sampling=gen_pb.SamplingParams(max_tokens=4)).SerializeToString()),
        Case("oversized", "grpc", "a message over 64 MiB",
             lambda p: p.call(t.grpc, GENERATE, hp.field(2, 2, _blob(over_64)), streaming=True)),
        Case("oversized", "kserve", "a ModelInfer over 64 MiB", lambda p: p.call(t.grpc, INFER, _blob(over_64))),
    ]
    return cases + _kserve("oversized", "a 5 MB text_input", t, _infer(t, prompt=big_prompt.encode()))


def _malformed_protobuf(t: Targets) -> list[Case]:
    cases = []
    for name, raw in hp.MALFORMED.items():
        cases.append(_grpc("malformed_protobuf", f"Generate: {name}", t, raw))
        cases.append(Case("malformed_protobuf", "kserve", f"ModelInfer: {name}", lambda p, raw=raw: p.call(t.grpc, INFER, raw)))
        cases.append(Case("malformed_protobuf", "kserve", f"ModelStreamInfer: {name}",
                          lambda p, raw=raw: p.call_stream(t.grpc, STREAM_INFER, [raw] * 3, kserve=True)))
        cases.append(Case("malformed_protobuf", "grpc", f"Health: {name}",
                          lambda p, raw=raw: p.call(t.grpc, HEALTH, raw)))
    return cases


def _wrong_types(t: Targets) -> list[Case]:
    http = {
        "max_tokens a string": ("/v1/completions", json.dumps(_completion(t, max_tokens="four"))),
        "prompt an object": ("/v1/completions", json.dumps(_completion(t, prompt={"a": 1}))),
        "messages a string": ("/v1/chat/completions", json.dumps(_chat(t, messages="hi"))),
        "a message's role a number": ("/v1/chat/completions", json.dumps(_chat(t, messages=[{"role": 5, "content": "x"}]))),
        "content a number": ("/v1/chat/completions", json.dumps(_chat(t, messages=[{"role": "user", "content": 5}]))),
        "tools a string": ("/v1/chat/completions", json.dumps(_chat(t, tools="all"))),
        "a tool a number": ("/v1/chat/completions", json.dumps(_chat(t, tools=[1], tool_choice="required"))),
        "tool_choice a number": ("/v1/chat/completions", json.dumps(_chat(t, tool_choice=5))),
        "response_format a list": ("/v1/chat/completions", json.dumps(_chat(t, response_format=[]))),
        "json_schema without a schema": ("/v1/chat/completions",
                                         json.dumps(_chat(t, response_format={"type": "json_schema"}))),
        "a schema a number": ("/v1/completions", json.dumps(_completion(t, structured_outputs={"json": 5}))),
        "stop a number": ("/v1/completions", json.dumps(_completion(t, stop=5))),
        "a body that is a list": ("/v1/completions", "[]"),
        "a body that is null": ("/v1/completions", "null"),
        "a body that is no JSON": ("/v1/completions", "{not json"),
        "an empty body": ("/v1/completions", ""),
        "stream_options a string": ("/v1/completions", json.dumps(_completion(t, stream=True, stream_options="x"))),
        "an unknown regex": ("/v1/completions", json.dumps(_completion(t, structured_outputs={"regex": "(("}))),
        "an invalid Lark grammar": ("/v1/completions", json.dumps(_completion(t, structured_outputs={"grammar": "start: ("}))),
        "a schema of an unknown type": ("/v1/completions",
                                        json.dumps(_completion(t, structured_outputs={"json": {"type": "frobnicate"}}))),
        "a $ref to nowhere": ("/v1/completions",
                              json.dumps(_completion(t, structured_outputs={"json": {"$ref": "#/$defs/none"}}))),
    }
    cases = [_http("wrong_types", name, path, body) for name, (path, body) in http.items()]
    cases.append(_http("wrong_types", "a text/plain body", "/v1/completions", json.dumps(_completion(t)), "text/plain"))
    for name, request in {"max_tokens 0": _generate(max_tokens=0), "top_p 2": _generate(top_p=2.0),
                          "temperature -1": _generate(temperature=-1.0), "empty prompt": _generate(text=""),
                          "json_schema no JSON": _generate(structured={"json_schema": "{not json"}),
                          "json_schema a list": _generate(structured={"json_schema": "[1, 2]"}),
                          "an empty choice": _generate(structured={"choice": gen_pb.Choices()}),
                          "an empty grammar": _generate(structured={"grammar": ""}),
                          "an unknown regex": _generate(structured={"regex": "(("}),
                          "no prompt": gen_pb.GenerateRequest().SerializeToString()}.items():
        cases.append(_grpc("wrong_types", name, t, request))
    wrong_type = _infer(t)
    wrong_type.inputs[0].datatype = "INT32"
    missing = _infer(t)
    del missing.inputs[0]
    del missing.raw_input_contents[0]
    mismatch = _infer(t)
    mismatch.raw_input_contents.append(b"extra")
    truncated = _infer(t)
    truncated.raw_input_contents[0] = b"\xff\xff\xff\x7fab"
    unknown_input = _infer(t)
    unknown_input.inputs.add(name="frob", datatype="BYTES", shape=[1])
    unknown_input.raw_input_contents.append(_tensor([b"x"]))
    for name, request in {"text_input INT32": wrong_type, "no text_input": missing, "raw contents mismatch": mismatch,
                          "a truncated BYTES tensor": truncated, "an unknown input": unknown_input,
                          "an unknown model": _infer(t, model="no-such-model"),
                          "sampling_parameters a list": _infer(t, sampling="[1]"),
                          "sampling_parameters no JSON": _infer(t, sampling="{"),
                          "an unknown sampling key": _infer(t, sampling='{"frob": 1}'),
                          "max_tokens a string": _infer(t, sampling='{"max_tokens": "four"}'),
                          "structured_outputs a list": _infer(t, sampling='{"structured_outputs": [1]}'),
                          "n 2": _infer(t, sampling='{"n": 2}')}.items():
        cases += _kserve("wrong_types", name, t, request)
    return cases


def _internal(t: Targets) -> list[Case]:
    """Internal services without the cluster credential, and with a wrong one: UNAUTHENTICATED or
    PERMISSION_DENIED, never served."""
    wrong = ((CLUSTER_SECRET_HEADER, "not-the-secret-0123456789abcdef"),)
    calls = [(a, "/pdserve.v1.Prefill/Prefill", False) for a in t.prefill]
    calls += [(a, m, m.endswith(("Decode", "Steps")))
              for a in t.decode for m in ("/pdserve.v1.Decode/Decode", "/pdserve.v1.Decode/Abort",
                                          "/pdserve.v1.Decode/Steps", "/pdserve.v1.KvTransfer/BeginKv")]
    calls += [(a, "/pdserve.v1.Control/GetInfo", False) for a in (*t.prefill, *t.decode)]
    calls += [(t.grpc, f"/pdserve.v1.Registry/{m}", False) for m in ("Register", "Heartbeat", "ListWorkers")]
    cases = []
    for address, method, streaming in calls:
        for label, metadata in (("no credential", ()), ("a wrong secret", wrong)):
            for body_name, body in (("empty", b""), ("garbage", hp.MALFORMED["random"])):
                cases.append(Case("internal_no_credential", "internal", f"{method} @ {address}: {label}, {body_name}",
                                  lambda p, a=address, m=method, s=streaming, md=metadata, b=body:
                                  _must_refuse(p.call(a, m, b, streaming=s, metadata=md))))
    for address in t.decode:
        for label, metadata in (("no credential", ()), ("a wrong secret", wrong)):
            cases.append(Case("internal_no_credential", "internal", f"PushKv @ {address}: {label}",
                              lambda p, a=address, md=metadata: _must_refuse(p.call_stream(
                                  a, "/pdserve.v1.KvTransfer/PushKv", [hp.MALFORMED["random"]] * 4, metadata=md))))
    return cases


def _must_refuse(outcome: Outcome) -> Outcome:
    """An internal call served without the credential is a hole, whatever its status says."""
    if outcome.kind == "served":
        return Outcome("failure", "served without credential", "an internal call answered OK without the secret")
    if outcome.kind == "client_error" and outcome.code not in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
        return Outcome("failure", f"{outcome.code} before authentication",
                       f"expected UNAUTHENTICATED or PERMISSION_DENIED: {outcome.detail}")
    return outcome


FAMILIES: dict[str, Callable[[Targets], list[Case]]] = {
    "schemas": _schemas, "grammar_bombs": _grammar_bombs, "huge_tools": _huge_tools, "deep_json": _deep_json,
    "bad_utf8": _bad_utf8, "big_ints": _big_ints, "nan_inf": _nan_inf, "oversized": _oversized,
    "malformed_protobuf": _malformed_protobuf, "wrong_types": _wrong_types, "internal_no_credential": _internal,
}


def families(t: Targets, only: list[str] | None = None) -> dict[str, list[Case]]:
    """Every family's cases (or those of `only`), their payloads built once."""
    unknown = set(only or ()) - set(FAMILIES)
    if unknown:
        raise ValueError(f"--families: unknown {', '.join(sorted(unknown))}; the families are {', '.join(FAMILIES)}")
    return {name: build(t) for name, build in FAMILIES.items() if not only or name in only}
