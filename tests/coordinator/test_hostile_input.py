"""What a client may send the public fronts (OpenAI HTTP, pdserve.v1.Generation, KServe) that Python or
protobuf cannot hand on (issue 38): integers outside int64, lone surrogates, NaN, nesting thousands deep,
malformed or oversized protobuf bytes, bodies over the limit however framed. Each is a 4xx / INVALID_ARGUMENT
naming the field, in vLLM's error shape, never a 500 / UNKNOWN, and the server keeps serving. Fuzzed with
schemathesis (the app's own OpenAPI schema) and hypothesis, bounded for CI; the cluster is the in-process
coordinator in front of scripted workers (fakes.py), served over real HTTP and gRPC on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass

import grpc
import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from tritonclient.grpc import service_pb2
from tritonclient.utils import serialize_byte_tensor

from pdserve.v1 import generation_pb2
from pdserve.server.coordinator.json_input import MAX_JSON_DEPTH, JsonRefused, check_json, parse_json
from pdserve.server.coordinator.openai.app import create_app
from pdserve.server.coordinator.openai.front import Front
from tests.coordinator.fakes import start_fake_pools

MODEL = "llama-float32"
EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "120"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=not os.environ.get("PDSERVE_FUZZ_RANDOM"),
                suppress_health_check=list(HealthCheck), database=None)
SURROGATE = '"a\\ud800b"'  # valid JSON; Python reads a str UTF-8 cannot encode


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama")


@pytest.fixture
async def pools(model_dir):
    pools = await start_fake_pools(model_dir, http_port=0, max_prompt_bytes=64 * 1024)
    yield pools
    await pools.stop()


@pytest.fixture
async def client(pools):
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{pools.coordinator.http.port}", timeout=30) as c:
        yield c


def _vllm_error(r, status: int | None = None) -> dict:
    """The body (an httpx or schemathesis response) is vLLM's ErrorResponse: message, type, param, and the
    status as an integer code."""
    code = r.status_code
    assert code >= 400 and (status is None or code == status), (code, r.content[:500])
    error = json.loads(r.content)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == code and isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and (error["param"] is None or isinstance(error["param"], str))
    return error


# ---- the JSON check on its own ----------------------------------------------------------------------------


def test_check_json_names_the_path_and_never_recurses():
    deep: list = []
    inner = deep
    for _ in range(100_000):  # far past Python's recursion limit: the walk is iterative
        inner.append([])
        inner = inner[0]
    with pytest.raises(JsonRefused, match=f"nested deeper than {MAX_JSON_DEPTH} levels"):
        check_json({"tools": deep})
    check_json(parse_json("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH))
    cases = {
        '{"prompt": [1, 18446744073709551616]}': "prompt[1]: the integer 18446744073709551616 lies outside",
        '{"stop_token_ids": [-9223372036854775809]}': "stop_token_ids[0]: the integer",
        '{"messages": [{"content": ' + SURROGATE + '}]}': "messages[0].content: the string holds \\ud800",
        '{"t": NaN}': "t: nan is not a finite number",
        '{"t": -Infinity}': "t: -inf is not a finite number",
        '{"a\\udc00": 1}': "a key holds \\udc00",
        "[" * 100_000: "nested too deep to parse",
        '{"x": 1' + "0" * 5000 + "}": "not valid JSON",
    }
    for raw, words in cases.items():
        with pytest.raises(JsonRefused) as e:
            check_json(parse_json(raw))
        assert words in str(e.value), (raw[:40], str(e.value))
        str(e.value).encode("utf-8")  # the message itself always encodes
    check_json(parse_json('{"prompt": [0, 18446744073709551615, -9223372036854775808], "t": 1e308, "s": "é😀"}'))


# ---- the OpenAI front: the cases, one by one --------------------------------------------------------


def _raw(body: str) -> dict:
    return {"content": body.encode(), "headers": {"content-type": "application/json"}}


@pytest.mark.parametrize(("path", "body", "param", "words"), [
    ("/v1/completions", '{"model": "M", "prompt": [1, 18446744073709551616]}', "prompt[1]", "outside [-2**63"),
    ("/v1/completions", '{"model": "M", "prompt": [9223372036854775807]}', "prompt", "lies outside [0, "),
    ("/v1/completions", '{"model": "M", "prompt": [9223372036854775808], "echo": true}', "prompt", "lies outside"),
    ("/v1/completions", '{"model": "M", "prompt": [-1], "echo": true}', "prompt", "lies outside"),
    ("/v1/completions", '{"model": "M", "prompt": "x", "stop_token_ids": [9223372036854775808]}', "stop_token_ids",
     "out of range"),
    ("/v1/completions", '{"model": "M", "prompt": "x", "seed": 18446744073709551616}', "seed", "outside"),
    ("/v1/completions", '{"model": "M", "prompt": "x", "max_tokens": 4294967296}', "max_tokens", "out of range"),
    ("/v1/completions", '{"model": "M", "prompt": ' + SURROGATE + "}", "prompt", "lone surrogate"),
    ("/v1/completions", '{"model": "M", "prompt": ["x"], "stop": [' + SURROGATE + "]}", "stop[0]", "lone surrogate"),
    ("/v1/completions", '{"model": "M", "prompt": "x", "temperature": NaN}', "temperature", "not a finite"),
    ("/v1/completions", '{"model": "M", "prompt": "x", "top_p": Infinity}', "top_p", "not a finite"),
    ("/v1/chat/completions", '{"model": "M", "messages": [{"role": "user", "content": ' + SURROGATE + "}]}",
     "messages[0].content", "lone surrogate"),
    ("/v1/chat/completions", '{"model": ' + SURROGATE + ', "messages": []}', "model", "lone surrogate"),
    ("/tokenize", '{"model": "M", "prompt": ' + SURROGATE + "}", "prompt", "lone surrogate"),
    ("/detokenize", '{"model": "M", "tokens": [1, 18446744073709551616]}', "tokens[1]", "outside"),
    ("/detokenize", '{"model": "M", "tokens": [9223372036854775807]}', "tokens", "lies outside"),
    ("/v1/chat/completions", '{"model": "M", "messages": [{"role": "user", "content": "x"}], "top_logprobs": -1}',
     "top_logprobs", "must be >= 0"),
])
async def test_values_python_cannot_hand_on_are_400_naming_the_field(pools, client, path, body, param, words):
    r = await client.post(path, **_raw(body.replace('"M"', f'"{MODEL}"')))
    error = _vllm_error(r, 400)
    assert error["param"] == param and words in error["message"], error
    ok = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


async def test_nesting_anywhere_is_a_400_never_a_recursion_error(pools, client):
    def nested(depth: int) -> str:
        return '{"a": ' * depth + "1" + "}" * depth

    chat = '{"model": "%s", "messages": [{"role": "user", "content": "x"}]' % MODEL
    bodies = {
        "body": "[" * 10_000 + "]" * 10_000,
        "tools[0].function.parameters": chat + ', "tools": [{"type": "function", "function": {"name": "f", '
                                        '"parameters": ' + nested(200) + "}}]}",
        "messages[0].content": '{"model": "%s", "messages": [{"role": "user", "content": %s}]}' % (MODEL, nested(150)),
        "response_format.json_schema.schema": chat + ', "response_format": {"type": "json_schema", "json_schema": '
                                              '{"name": "s", "schema": ' + nested(300) + "}}}",
    }
    for where, body in bodies.items():
        r = await client.post("/v1/chat/completions", **_raw(body))
        error = _vllm_error(r, 400)
        assert "nested" in error["message"] and (where == "body" or error["message"].startswith(where[:8])), error


async def test_unknown_model_with_a_lone_surrogate_and_every_other_error_is_vllm_shaped(pools, client):
    r = await client.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"})
    assert "gpt-4" in _vllm_error(r, 404)["message"]
    front = Front(generation=None, model_name=MODEL, aliases=(), max_model_len=512, chat=None,  # type: ignore[arg-type]
                  ready=lambda: False)
    with pytest.raises(Exception) as e:
        front.check_model("a\ud800b")
    assert e.value.response().body.decode("ascii").count("\\\\ud800") == 1  # escaped in the message, encodable
    _vllm_error(await client.get("/v1/nothing"), 404)
    _vllm_error(await client.get("/v1/completions"), 405)
    _vllm_error(await client.post("/v1/completions", **_raw("{not json")), 400)
    _vllm_error(await client.post("/v1/completions", **_raw('{"model": "%s"}' % MODEL)), 400)
    _vllm_error(await client.post("/v1/completions", **_raw('"\\ud800"')), 400)


async def test_top_logprobs_zero_without_logprobs_is_vllms_default(pools, client):
    r = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 0, "max_tokens": 2})
    assert r.status_code == 200, r.text
    r = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})
    assert "needs logprobs" in _vllm_error(r, 400)["message"]


async def test_bodies_over_the_limit_are_413_however_framed(pools, client):
    limit = 2 * 64 * 1024 + 2**20  # serve_http's: twice max_prompt_bytes, plus 1 MiB
    body = json.dumps({"model": MODEL, "prompt": "x" * (limit + 10)}).encode()

    async def chunks():
        for i in range(0, len(body), 65536):
            yield body[i:i + 65536]

    for content in (body, chunks()):  # Content-Length, then chunked (no length declared)
        r = await client.post("/v1/completions", content=content, headers={"content-type": "application/json"})
        assert "exceeds the limit" in _vllm_error(r, 413)["message"]
    ok = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


async def test_long_work_leaves_the_event_loop(model_dir):
    """A tick task on the server's loop while the front tokenizes a ~1 MB prompt, renders and tokenizes it
    as a chat, and decodes its ids: the work runs in threads that release the GIL, so the loop's worst gap
    is a small part of each request's time (on the loop, it would be all of it)."""
    pools = await start_fake_pools(model_dir, http_port=0)
    gaps: list[float] = []

    async def tick() -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    text = "héllo wörld, " * 70_000  # ~1 MB, under the default max_prompt_bytes (4 MiB)
    ticker = asyncio.create_task(tick())
    report = []
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{pools.coordinator.http.port}", timeout=120) as c:
            ids = (await c.post("/tokenize", json={"model": MODEL, "prompt": text})).json()["tokens"]
            for path, body in [("/tokenize", {"model": MODEL, "prompt": text}),
                               ("/tokenize", {"model": MODEL, "prompt": text, "add_special_tokens": False}),
                               ("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": text}]}),
                               ("/detokenize", {"model": MODEL, "tokens": ids})]:
                await asyncio.sleep(0.01)
                gaps.clear()
                started = time.perf_counter()
                r = await c.post(path, json=body)
                elapsed = time.perf_counter() - started
                assert r.status_code == 200, r.text[:300]
                report.append((path, elapsed, max(gaps)))
    finally:
        ticker.cancel()
        await pools.stop()
    print("\n" + "\n".join(f"{p}: {e * 1000:.0f} ms, worst loop gap {g * 1000:.1f} ms" for p, e, g in report))
    for path, elapsed, worst in report:
        assert worst < 0.5 * elapsed, (path, elapsed, worst)


# ---- the OpenAI front, fuzzed ------------------------------------------------------------------------------


hostile_text = st.sampled_from(["\ud800", "a\udfffb", "\x00", "é😀", "", "\u202e", "x" * 70]) | st.text(max_size=8)
hostile_int = st.sampled_from([-1, 0, 2**31, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -2**63 - 1, 10**40])
hostile_float = st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e308, -0.0, 5e-324])
leaf = st.none() | st.booleans() | hostile_int | hostile_float | hostile_text | st.integers(-5, 600)
junk = st.recursive(leaf, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(hostile_text, inner, max_size=3),
                    max_leaves=8)


@dataclass(frozen=True)
class Deep:
    """`value` inside `depth` levels of {"a": [...]}, written as JSON text by _encode (no recursion)."""

    value: object
    depth: int


def _encode(value) -> str:
    if isinstance(value, Deep):
        return '{"a": [' * value.depth + _encode(value.value) + "]}" * value.depth
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)}: {_encode(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_encode(v) for v in value) + "]"
    return json.dumps(value, allow_nan=True)  # NaN and Infinity as Python writes them; "\ud800" escaped


FIELDS = ["prompt", "messages", "stop", "stop_token_ids", "max_tokens", "temperature", "top_p", "top_k", "seed", "n",
          "logprobs", "top_logprobs", "echo", "min_tokens", "tools", "tool_choice", "response_format",
          "structured_outputs", "chat_template_kwargs", "stream", "stream_options", "tokens", "add_special_tokens"]


@st.composite
def hostile_bodies(draw):
    path = draw(st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]))
    body = {"model": draw(st.just(MODEL) | st.just(MODEL) | hostile_text)}
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": draw(st.just("x") | hostile_text)}]
    elif path == "/detokenize":
        body["tokens"] = draw(st.lists(st.integers(0, 500) | hostile_int, max_size=4))
    else:
        body["prompt"] = draw(st.just("x") | hostile_text | st.lists(st.integers(0, 500) | hostile_int, max_size=4))
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=3, unique=True)):
        body[name] = draw(junk | st.builds(Deep, junk, st.integers(100, 2000)))
    return path, body


def _fuzz_http(base: str, cases: st.SearchStrategy) -> dict[int, int]:
    """Runs in a thread (the server runs on the test's loop); every answer below 500, errors vLLM-shaped."""
    seen: dict[int, int] = {}

    @FUZZ
    @given(cases)
    def one(case):
        path, body = case
        raw = _encode(body).encode() if isinstance(body, dict) else json.dumps(body).encode()
        with httpx.Client(base_url=base, timeout=30) as c:
            r = c.post(path, content=raw, headers={"content-type": "application/json"})
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (path, raw[:300], r.status_code, r.text[:500])
        if r.status_code >= 400:
            _vllm_error(r)

    one()
    return seen


async def test_hypothesis_hostile_bodies_are_never_a_500(pools, client):
    base = f"http://127.0.0.1:{pools.coordinator.http.port}"
    seen = await asyncio.to_thread(_fuzz_http, base, hostile_bodies())
    print(f"\nhostile bodies, by status: {seen}")
    assert sum(seen.values()) >= min(EXAMPLES, 50) and any(400 <= s < 500 for s in seen)
    assert (await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})).status_code == 200


def _schemathesis_cases(app) -> st.SearchStrategy:
    """(path, body) from the app's own OpenAPI schema, positive and negative, `model` mostly the served one."""
    raw = app.openapi()
    for name in ("CompletionRequest", "ChatRequest", "TokenizeRequest", "DetokenizeRequest"):
        raw["components"]["schemas"][name]["properties"]["model"] = {"type": "string", "enum": [MODEL]}
    schema = schemathesis.openapi.from_dict(raw)
    strategies = []
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.method.upper() != "POST":
            continue
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            strategies.append(operation.as_strategy(generation_mode=mode))
    return st.one_of(strategies)


def _fuzz_schemathesis(base: str, cases: st.SearchStrategy) -> dict[int, int]:
    """Runs in a thread: each case sent by schemathesis' own transport (its body as it serializes it)."""
    seen: dict[int, int] = {}

    @FUZZ
    @given(cases)
    def one(case):
        r = case.call(base_url=base, timeout=30)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (case.operation.label, case.body, r.status_code, r.content[:500])
        if r.status_code >= 400:
            _vllm_error(r)

    one()
    return seen


async def test_schemathesis_openapi_fuzz_is_never_a_500(pools, client):
    app = create_app(Front(generation=None, model_name=MODEL, aliases=(), max_model_len=512, chat=None,  # type: ignore[arg-type]
                           ready=lambda: False))
    base = f"http://127.0.0.1:{pools.coordinator.http.port}"
    seen = await asyncio.to_thread(_fuzz_schemathesis, base, _schemathesis_cases(app))
    print(f"\nschemathesis cases, by status: {seen}")
    assert seen.get(200, 0) > 0 and any(400 <= s < 500 for s in seen), seen


# ---- the gRPC fronts: raw bytes and hostile values ----------------------------------------------------------

GENERATE = "/pdserve.v1.Generation/Generate"
INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"
REFUSALS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.OUT_OF_RANGE)


def _nested_proto(depth: int) -> bytes:
    """Length-delimited field 4 inside field 4 ... `depth` times: what each front's message makes of it (a
    tensor, a map entry, a sampling message) fails to parse somewhere down, thousands of levels deep."""
    out = b"\x0a\x01x"
    for _ in range(depth):
        out = b"\x22" + _varint(len(out)) + out  # field 4, length-delimited, holding the previous
    return out


def _varint(n: int) -> bytes:
    out = b""
    while True:
        byte, n = n & 0x7F, n >> 7
        out += bytes([byte | (0x80 if n else 0)])
        if not n:
            return out


async def _raw_call(channel: grpc.aio.Channel, method: str, raw: bytes) -> grpc.StatusCode:
    identity = {"request_serializer": lambda b: b, "response_deserializer": lambda b: b}
    try:
        if method == GENERATE:
            [_ async for _ in channel.unary_stream(method, **identity)(raw, timeout=20)]
        elif method == INFER:
            await channel.unary_unary(method, **identity)(raw, timeout=20)
        else:
            [_ async for _ in channel.stream_stream(method, **identity)(iter([raw]), timeout=20)]
    except grpc.RpcError as e:
        assert e.code() in REFUSALS, (method, raw[:80], e.code(), e.details())
        assert e.details()
        return e.code()
    return grpc.StatusCode.OK


async def test_malformed_and_oversized_protobufs_get_a_status(pools):
    crafted = [b"\xff\xff\xff", b"\x12\x02\xc3\x28", b"\x0a" + b"\xff" * 10, b"\x1a\x05\x0a\x03\xff\xfe\xfd",
               _nested_proto(200), _nested_proto(5000), b"\x0a\xff\xff\xff\xff\x0f" + b"x" * 100]
    randoms = [os.urandom(n) for n in (1, 3, 7, 16, 64, 300)] + [bytes(range(256))]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{pools.coordinator.port}",
                                         options=[("grpc.max_send_message_length", 200 * 2**20)]) as channel:
        codes = {}
        for method in (GENERATE, INFER, STREAM_INFER):
            for raw in crafted + randoms:
                code = await _raw_call(channel, method, raw)
                codes[code] = codes.get(code, 0) + 1
            assert await _raw_call(channel, method, b"\x00" * (65 * 2**20)) in REFUSALS  # over the 64 MiB limit
        assert grpc.StatusCode.INVALID_ARGUMENT in codes, codes
        request = generation_pb2.GenerateRequest(text="x", sampling=generation_pb2.SamplingParams(max_tokens=2))
        out = [m async for m in channel.unary_stream(GENERATE, request_serializer=lambda m: m.SerializeToString(),
                                                     response_deserializer=generation_pb2.GenerateResponse.FromString)(
            request, timeout=20)]
        assert out and out[-1].finish_reason


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.lists(st.binary(max_size=48), min_size=1, max_size=1))
def _random_bytes_case(raws):  # drawn in the test below (hypothesis needs a sync function)
    _random_bytes_case.drawn.append(raws[0])


async def test_hypothesis_random_bytes_at_both_grpc_fronts(pools):
    _random_bytes_case.drawn = []
    _random_bytes_case()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{pools.coordinator.port}") as channel:
        for raw in _random_bytes_case.drawn:
            for method in (GENERATE, INFER, STREAM_INFER):
                await _raw_call(channel, method, raw)
    assert len(_random_bytes_case.drawn) >= min(EXAMPLES, 50)


def _infer(sampling_json: bytes) -> service_pb2.ModelInferRequest:
    def tensor(name: str) -> service_pb2.ModelInferRequest.InferInputTensor:
        return service_pb2.ModelInferRequest.InferInputTensor(name=name, datatype="BYTES", shape=[1])

    request = service_pb2.ModelInferRequest(model_name=MODEL, inputs=[tensor("text_input"),
                                                                       tensor("sampling_parameters")])
    request.raw_input_contents.extend([serialize_byte_tensor(_obj(b"hello")).item(),
                                       serialize_byte_tensor(_obj(sampling_json)).item()])
    return request


def _obj(value: bytes):
    import numpy as np

    return np.array([value], dtype=np.object_)


async def test_kserve_hostile_sampling_json_is_invalid_argument_naming_it(pools):
    cases = {
        b'{"max_tokens": 2, "stop_token_ids": [18446744073709551616]}': "stop_token_ids[0]",
        b'{"max_tokens": 2, "stop": [' + SURROGATE.encode() + b"]}": "stop[0]",
        b'{"max_tokens": 2, "temperature": NaN}': "temperature",
        b'{"max_tokens": 2, "seed": 1' + b"0" * 5000 + b"}": "not valid JSON",
        b'{"max_tokens": 2, "structured_outputs": ' + b'{"a": ' * 3000 + b"1" + b"}" * 3000 + b"}": "nested",
        b"[" * 50_000: "nested too deep",
        b'{"max_tokens": 2, "stop_token_ids": "[' + b"[" * 5000 + b']"}': "stop_token_ids",
    }
    async with grpc.aio.insecure_channel(f"127.0.0.1:{pools.coordinator.port}") as channel:
        infer = channel.unary_unary(INFER, request_serializer=lambda m: m.SerializeToString(),
                                    response_deserializer=service_pb2.ModelInferResponse.FromString)
        for raw, words in cases.items():
            with pytest.raises(grpc.RpcError) as e:
                await infer(_infer(raw), timeout=20)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details(), (
                raw[:60], e.value.code(), e.value.details())
        reply = await infer(_infer(b'{"max_tokens": 2}'), timeout=20)
        assert reply.outputs


async def test_generation_deep_schema_text_is_invalid_argument(pools):
    schema = '{"type": "object", "properties": {"a": ' * 5000 + "{}" + "}}" * 5000
    for structured in (generation_pb2.StructuredOutput(json_schema=schema),
                       generation_pb2.StructuredOutput(json_schema="[" * 100_000)):
        request = generation_pb2.GenerateRequest(text="x", sampling=generation_pb2.SamplingParams(
            max_tokens=2, structured=structured))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{pools.coordinator.port}") as channel:
            call = channel.unary_stream(GENERATE, request_serializer=lambda m: m.SerializeToString(),
                                        response_deserializer=generation_pb2.GenerateResponse.FromString)
            with pytest.raises(grpc.RpcError) as e:
                [_ async for _ in call(request, timeout=30)]
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.value.code(), e.value.details())
