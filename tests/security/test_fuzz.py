"""Hypothesis over the public fronts of a real cluster (OpenAI HTTP, KServe gRPC): whatever the body,
the answer is a success or a 4xx/503/504 OpenAI error object (a gRPC status other than INTERNAL or
UNKNOWN), never a 500, and afterwards no KV block is left taken."""

from __future__ import annotations

import json
import os

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2, service_pb2_grpc

from tests.e2e.procs import wait_blocks_free

FUZZ = settings(max_examples=int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "60")), deadline=None,
                derandomize=not os.environ.get("PDSERVE_FUZZ_RANDOM"),
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
STATS = {"inputs": 0, "ok": 0, "refusals": 0, "named": 0, "crashes": 0}

junk = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
ints = st.integers(-3, 12) | st.sampled_from([0, 511, 512, 513, 2**31, 2**63, -2**63, 10**30])
floats = st.floats() | st.sampled_from([0.0, 1e-300, 1e-6, 1e-5, 0.5, 1.0, 2.0, 1e38, 1e308])
texts = st.text(max_size=40)
ids = st.lists(st.integers(-2, 600) | st.sampled_from([2**63 - 1, -2**63]), max_size=12)


def _or_junk(good):
    return st.one_of(good, good, junk)


SAMPLING = {
    "max_tokens": _or_junk(ints), "temperature": _or_junk(floats), "top_p": _or_junk(floats),
    "top_k": _or_junk(ints), "seed": _or_junk(ints), "stop": _or_junk(texts | st.lists(texts, max_size=20)),
    "stop_token_ids": _or_junk(ids), "stream": _or_junk(st.booleans()), "ignore_eos": _or_junk(st.booleans()),
    "stream_options": _or_junk(st.fixed_dictionaries({"include_usage": st.booleans()})), "n": _or_junk(ints),
    "presence_penalty": _or_junk(floats), "logit_bias": _or_junk(st.dictionaries(texts, floats, max_size=2)),
    "min_tokens": _or_junk(ints), "best_of": _or_junk(ints),
}
SANE = {  # values a real client sends: most of these requests generate (streamed or not)
    "max_tokens": st.integers(1, 12), "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1),
    "top_k": st.integers(0, 50), "seed": st.integers(0, 2**64 - 1), "stop": st.lists(st.text(min_size=1, max_size=3),
                                                                                      max_size=3),
    "stream": st.booleans(), "ignore_eos": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
}
messages = st.lists(st.fixed_dictionaries({
    "role": _or_junk(st.sampled_from(["user", "assistant", "system", "wizard"])),
    "content": _or_junk(texts | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": texts}), max_size=2)),
}), max_size=3)


def _sane(model: str):
    completion = st.fixed_dictionaries({"model": st.just(model), "prompt": texts | st.lists(st.integers(0, 511),
                                                                                             min_size=1, max_size=12)},
                                       optional=SANE)
    chat = st.fixed_dictionaries({"model": st.just(model), "messages": st.lists(st.fixed_dictionaries({
        "role": st.sampled_from(["user", "assistant", "system"]), "content": texts}), min_size=1, max_size=3)},
        optional=SANE)
    return st.tuples(st.just("/v1/completions"), completion) | st.tuples(st.just("/v1/chat/completions"), chat)


def _bodies(model: str):
    name = _or_junk(st.just(model))
    completion = st.fixed_dictionaries({"model": name}, optional={
        "prompt": _or_junk(texts | ids | st.lists(texts, max_size=2) | st.lists(ids, max_size=2)),
        "echo": _or_junk(st.booleans()), "suffix": _or_junk(texts), "logprobs": _or_junk(ints), **SAMPLING})
    chat = st.fixed_dictionaries({"model": name}, optional={
        "messages": _or_junk(messages), "max_completion_tokens": _or_junk(ints), "tools": _or_junk(st.lists(junk)),
        "response_format": _or_junk(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])})),
        **SAMPLING})
    return st.one_of(st.tuples(st.just("/v1/completions"), completion), st.tuples(st.just("/v1/chat/completions"), chat),
                     st.tuples(st.sampled_from(["/tokenize", "/detokenize"]),
                               st.fixed_dictionaries({"model": name}, optional={
                                   "prompt": _or_junk(texts), "tokens": _or_junk(ids), "messages": _or_junk(messages)})))


def _encode(body) -> bytes:
    return json.dumps(body, allow_nan=True).encode()  # NaN and Infinity as Python's json writes them


def _check_error(status: int | None, payload: dict) -> None:
    """vLLM's ErrorResponse: `code` the HTTP status (an integer), for a streamed error event too."""
    error = payload["error"]
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    assert type(error["code"]) is int and error["code"] >= 400 and error["code"] == (status or error["code"]), error
    STATS["refusals"] += 1
    STATS["named"] += error.get("param") is not None


@pytest.fixture(scope="module")
def http(secured):
    base = f"http://127.0.0.1:{secured.http_port}"
    with httpx.Client(base_url=base, timeout=120) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        yield client, model
    d0, d1 = secured.procs["d0"], secured.procs["d1"]
    assert all(free == total for free, total in wait_blocks_free([d0, d1])), "a fuzzed request leaked blocks"
    assert all(p.popen.poll() is None for p in secured.procs.values())
    print(f"\nfuzz: {STATS['inputs']} inputs, {STATS['ok']} served, {STATS['crashes']} 500s, {STATS['refusals']} refusals, "
          f"{STATS['named']} of them name the field")


@given(data=st.data())
@FUZZ
def test_openai_front_never_answers_500(http, data):
    client, model = http
    path, body = data.draw(_sane(model) | _bodies(model))
    raw = _encode(body) if data.draw(st.integers(0, 9)) else data.draw(st.binary(max_size=60))
    STATS["inputs"] += 1
    with client.stream("POST", path, content=raw, headers={"content-type": "application/json"}) as r:
        text = r.read().decode()
    STATS["ok"] += r.status_code == 200
    STATS["crashes"] += r.status_code >= 500 and r.status_code not in (503, 504)
    assert r.status_code < 500 or r.status_code in (503, 504), (path, body, r.status_code, text)
    if r.status_code >= 400:
        _check_error(r.status_code, json.loads(text))
    elif text.startswith("data:"):
        for line in text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if "error" in event:
                    assert event["error"]["type"] != "server_error", event
                    _check_error(None, event)


def _tensor(draw, name_st):
    name = draw(name_st)
    datatype = draw(st.sampled_from(["BYTES", "BOOL", "INT32", "FP32", ""]))
    shape = draw(st.lists(st.integers(-1, 3), max_size=3))
    contents = service_pb2.InferTensorContents()
    if name == "sampling_parameters" and draw(st.booleans()):
        body = draw(st.fixed_dictionaries({}, optional=draw(st.sampled_from([SAMPLING, SANE]))))
        contents.bytes_contents.append(_encode(body))
    elif datatype == "BOOL":
        contents.bool_contents.extend(draw(st.lists(st.booleans(), max_size=2)))
    else:
        contents.bytes_contents.extend(draw(st.lists(st.binary(max_size=30) | texts.map(str.encode), max_size=2)))
    return service_pb2.ModelInferRequest.InferInputTensor(name=name, datatype=datatype, shape=shape,
                                                          contents=contents)


@given(data=st.data())
@FUZZ
def test_kserve_front_never_fails_internally(secured, http, data):
    _, model = http
    coordinator = secured.procs["coordinator"]
    names = st.sampled_from(["text_input", "stream", "sampling_parameters", "exclude_input_in_output", "prompt", ""])
    request = service_pb2.ModelInferRequest(
        model_name=data.draw(st.sampled_from([model, "", "other"])),
        inputs=[_tensor(data.draw, names) for _ in range(data.draw(st.integers(0, 4)))],
    )
    STATS["inputs"] += 1
    with grpc.insecure_channel(coordinator.address) as ch:
        try:
            service_pb2_grpc.GRPCInferenceServiceStub(ch).ModelInfer(request, timeout=120)
            STATS["ok"] += 1
        except grpc.RpcError as e:
            STATS["crashes"] += e.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
            assert e.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (request, e.details())
            assert e.details()
            STATS["refusals"] += 1
            STATS["named"] += any(n in e.details() for n in ("text_input", "sampling_parameters", "stream", "model",
                                                              "max_tokens", "temperature", "top_p", "top_k", "seed",
                                                              "stop", "input", "exclude_input_in_output"))
