"""The OpenAI-compatible HTTP front, over real HTTP (uvicorn), against scripted in-process workers."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import prometheus_client
import pytest

from pdserve.v1 import generation_pb2
from pdserve.server.coordinator.chat_template import ChatTemplate, ChatTemplateError
from pdserve.server.coordinator.main import Coordinator
from pdserve.server.coordinator.openai.app import create_app
from pdserve.server.coordinator.openai.front import Front
from pdserve.server.coordinator.openai.handler import Handler
from pdserve.server.coordinator.openai.protocol import ChatRequest, CompletionRequest
from pdserve.server.coordinator.openai.sse import sse_event
from pdserve.server.model.tokenizer import Tokenizer
from tests.coordinator.fakes import FakeDecode, FakePrefill, start_fake_pools, wait_for

FinishReason = generation_pb2.FinishReason
MODEL = "llama-float32"
MAX_MODEL_LEN = 512


@dataclass
class Cluster:
    coordinator: Coordinator
    prefill: FakePrefill
    decode: FakeDecode
    tokenizer: Tokenizer
    base: str

    def script(self, ids: list[int], finish: int | None = FinishReason.FINISH_REASON_LENGTH) -> None:
        """The output: the first id from prefill, then one decode event per id."""
        self.prefill.first_token_id = ids[0]
        self.decode.events = [[i] for i in ids[1:]]
        self.decode.finish = finish


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> Path:
    return tiny_model("llama")


@pytest.fixture
async def cluster(model_dir):
    pools = await start_fake_pools(model_dir, http_port=0)
    coordinator = pools.coordinator
    assert coordinator.http is not None
    yield Cluster(
        coordinator,
        pools.prefill,
        pools.decode,
        Tokenizer.from_dir(model_dir),
        f"http://127.0.0.1:{coordinator.http.port}",
    )
    await pools.stop()


@pytest.fixture
async def client(cluster):
    async with httpx.AsyncClient(base_url=cluster.base, timeout=10) as c:
        yield c


@pytest.fixture
async def sdk(cluster):
    """The OpenAI SDK's client, closed by the test that used it. One left to the garbage collector closes its
    connections from a task its __del__ schedules; by then the socket was closed by the collector and its fd
    number may belong to a new server's listener, which asyncio's late `remove_reader` then unregisters (the
    next server accepts nothing: a read timeout, seen in CI)."""
    async with openai.AsyncOpenAI(base_url=f"{cluster.base}/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


async def test_completion_without_stream(cluster, client):
    ids = cluster.tokenizer.encode(" print('hello')")
    cluster.script(ids)
    r = await client.post(
        "/v1/completions",
        json={
            "model": MODEL,
            "prompt": "import os",
            "max_tokens": len(ids),
            "temperature": 0,
            "seed": 3,
            "stop": "zzz",
        },
    )
    assert r.status_code == 200
    body = r.json()
    prompt = cluster.tokenizer.encode("import os")
    assert body["object"] == "text_completion" and body["model"] == MODEL and body["id"].startswith("cmpl-")
    assert body["choices"] == [
        {"index": 0, "text": " print('hello')", "logprobs": None, "finish_reason": "length", "stop_reason": None}
    ]
    assert body["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": len(ids),
        "total_tokens": len(prompt) + len(ids),
    }
    (sent,) = cluster.decode.requests
    assert list(sent.prompt_token_ids) == prompt
    assert (sent.sampling.max_tokens, sent.sampling.temperature, sent.sampling.seed) == (len(ids), 0.0, 3)
    assert list(sent.sampling.stop) == ["zzz"]
    assert sent.request_id.startswith(body["id"] + ".")


async def test_completion_stream_through_the_sdk_with_usage(cluster, sdk):
    ids = cluster.tokenizer.encode("x = 1\ny = 2")
    cluster.script(ids, FinishReason.FINISH_REASON_STOP)
    chunks = [
        c
        async for c in await sdk.completions.create(
            model=MODEL,
            prompt=[5, 6, 7],
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"top_k": 4, "ignore_eos": True},
        )
    ]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "x = 1\ny = 2"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)
    assert chunks[-1].usage.prompt_tokens == 3
    (sent,) = cluster.decode.requests
    assert list(sent.prompt_token_ids) == [5, 6, 7]
    assert (sent.sampling.top_k, sent.sampling.ignore_eos, sent.sampling.max_tokens) == (4, True, 20)


async def test_skip_special_tokens_false_puts_their_text_in_the_output(cluster, sdk):
    eos = cluster.tokenizer.eos_token_ids[0]
    for skip, tail in [(None, ""), (False, "<|endoftext|>")]:
        cluster.decode.requests.clear()
        cluster.script([*cluster.tokenizer.encode(" ok"), eos], FinishReason.FINISH_REASON_STOP)
        extra = {} if skip is None else {"skip_special_tokens": skip}
        out = await sdk.completions.create(model=MODEL, prompt="x", max_tokens=8, extra_body=extra)
        assert out.choices[0].text == " ok" + tail


async def test_chat_stream_renders_the_template_and_streams_deltas(cluster, model_dir, sdk):
    ids = cluster.tokenizer.encode("Hi there!")
    cluster.script(ids)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    chunks = [
        c
        async for c in await sdk.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=len(ids), stream=True, temperature=0
        )
    ]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hi there!"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    rendered = "<|system|>\nBe brief.\n<|user|>\nhi\n<|assistant|>\n"
    assert ChatTemplate.from_dir(model_dir).render(messages) == rendered
    assert list(cluster.decode.requests[0].prompt_token_ids) == cluster.tokenizer.encode(rendered)


async def test_chat_without_stream_defaults_max_tokens_to_the_rest_of_the_context(cluster, sdk):
    ids = cluster.tokenizer.encode("ok")
    cluster.script(ids, FinishReason.FINISH_REASON_STOP)
    reply = await sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}]
    )
    assert reply.choices[0].message.content == "ok" and reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == "stop" and reply.object == "chat.completion"
    prompt = list(cluster.decode.requests[0].prompt_token_ids)
    assert cluster.decode.requests[0].sampling.max_tokens == MAX_MODEL_LEN - len(prompt)
    assert reply.usage.prompt_tokens == len(prompt)


@pytest.mark.parametrize(
    "path, body, param, words",
    [
        ("/v1/completions", {"prompt": "x", "n": 17}, "n", "n must lie in [1, 16]"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs", "logprobs must lie in [0, 20]"),
        ("/v1/completions", {"prompt": "x", "best_of_n": 2}, "best_of_n", "unknown field"),
        ("/v1/completions", {"prompt": "x", "min_p": 1.5}, "min_p", "min_p must lie in [0, 1]"),
        ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "must be > 0"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 3}, "min_tokens", "exceeds max_tokens"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            "top_logprobs",
            "needs logprobs: true",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "low"},
            "reasoning_effort",
            "unknown field",
        ),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature", "temperature must be >= 0"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens must be >= 1"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
            "max_tokens",
            "max_tokens must be >= 1",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "max_tokens": 600},
            "max_tokens",
            "exceeds the model's max_model_len",
        ),
        ("/v1/completions", {"prompt": [1, 99999]}, "prompt", "lies outside"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt", "batches of 2 prompts"),
        ("/v1/completions", {}, "prompt", "Field required"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens", "valid integer"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": 7, "content": "x"}]},
            "messages",
            "role must be a string",
        ),
        ("/v1/chat/completions", {"messages": []}, "messages", "at least one message"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages",
            "only text parts",
        ),
    ],
)
async def test_bad_fields_get_400_with_an_openai_error_and_the_server_keeps_serving(
    cluster, client, path, body, param, words
):
    r = await client.post(path, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert words in error["message"]
    assert cluster.decode.requests == []
    cluster.script([5, 6])
    ok = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


async def test_invalid_json_unknown_model_and_unknown_route(client):
    r = await client.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = await client.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    r = await client.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


async def test_sdk_raises_bad_request_error(cluster, sdk):
    with pytest.raises(openai.BadRequestError) as e:
        await sdk.completions.create(model=MODEL, prompt="x", n=17)
    assert e.value.status_code == 400 and "n must lie in [1, 16]" in e.value.message


async def test_n_choices_are_n_generations_with_seeds_in_turn(cluster, sdk):
    ids = cluster.tokenizer.encode(" print('hello')")
    cluster.script(ids)
    reply = await sdk.completions.create(model=MODEL, prompt="x", n=3, seed=7, max_tokens=len(ids), logprobs=0)
    text = cluster.tokenizer.decode(ids)
    assert [(c.index, c.text, c.finish_reason) for c in reply.choices] == [(i, text, "length") for i in range(3)]
    assert [len(c.logprobs.tokens) for c in reply.choices] == [len(ids)] * 3
    assert reply.usage.completion_tokens == 3 * len(ids)
    assert reply.usage.prompt_tokens == len(cluster.tokenizer.encode("x"))  # the prompt counted once
    assert sorted(r.sampling.seed for r in cluster.decode.requests) == [7, 8, 9]

    cluster.script(ids)
    chunks = [c async for c in await sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], n=2, max_tokens=len(ids), stream=True,
        stream_options={"include_usage": True})]
    for i in range(2):
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i) == text
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].index == i][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 2 * len(ids)


async def test_admission_rejection_is_429_with_retry_after(cluster, client):
    cluster.decode.refuse = grpc.StatusCode.RESOURCE_EXHAUSTED  # the worker is full: the request would queue,
    cluster.coordinator.service.router.decode_queue.max_size = 0  # but the coordinator's queue takes none
    for stream in (False, True):
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "stream": stream})
        assert r.status_code == 429
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "rate_limit_error"


async def test_mid_stream_failure_is_an_sse_error_event(cluster, client):
    cluster.script([5, 6, 7, 8])
    cluster.decode.die_after = 1
    async with client.stream(
        "POST", "/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True}
    ) as r:
        assert r.status_code == 200
        events = [line[len("data: ") :] async for line in r.aiter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "decode worker" in error["message"] and error["code"] == 503


async def test_stream_client_disconnect_cancels_the_request(cluster, client):
    cluster.script([5, 6, 7], finish=None)  # decode hangs after its events, until cancelled
    async with client.stream(
        "POST",
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True},
    ) as r:
        lines = r.aiter_lines()
        assert (await anext(lines)).startswith("data: ")
    assert await wait_for(cluster.decode.cancelled)
    await _no_inflight(cluster)


async def test_non_stream_client_disconnect_cancels_the_request(cluster, client):
    cluster.script([5, 6], finish=None)
    with pytest.raises(httpx.ReadTimeout):
        await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=0.5)
    assert await wait_for(cluster.decode.cancelled)
    await _no_inflight(cluster)


async def _no_inflight(cluster: Cluster) -> None:
    for _ in range(100):
        if all(w.inflight == 0 for w in cluster.coordinator.pool.workers.values()):
            return
        await asyncio.sleep(0.02)
    assert [w.inflight for w in cluster.coordinator.pool.workers.values()] == [0, 0]


async def test_models_health_and_metrics(cluster, client, sdk):
    models = await sdk.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert (await client.get("/health")).status_code == 200
    r = await client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert "# TYPE" in r.text


# --- the app alone (no workers), through ASGI ---------------------------------------------------


def _front(model_dir: Path, **kw) -> Front:
    defaults = dict(
        generation=None,
        model_name=MODEL,
        aliases=(),
        max_model_len=MAX_MODEL_LEN,
        chat=ChatTemplate.from_dir(model_dir),
        ready=lambda: False,
    )
    return Front(**{**defaults, **kw})  # type: ignore[arg-type]


async def _asgi(front: Front) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(front)), base_url="http://test")


async def test_api_key_is_required_on_v1_when_set(model_dir):
    async with await _asgi(_front(model_dir, api_key="s3cret")) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = await c.get("/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == 401
        r = await c.post("/v1/completions", json={"model": MODEL})
        assert r.status_code == 401
        assert (await c.get("/v1/models", headers={"Authorization": "Bearer s3cret"})).status_code == 200
        assert (await c.get("/health")).status_code == 503  # probes need no key; no worker is ready


async def test_a_model_without_chat_template_gets_a_clear_400(model_dir):
    async with await _asgi(_front(model_dir, chat=None)) as c:
        r = await c.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
        )
    assert r.status_code == 400
    assert (
        r.json()["error"]["code"] == 400 and "no chat template" in r.json()["error"]["message"]
    )


def test_chat_template_from_tokenizer_config_and_its_errors(tmp_path, model_dir):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [
        {
            "name": "default",
            "template": (
                "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
                "{{ raise_exception('System role not supported') }}{% endif %}"
                "[{{ m['content'] }}]{% endfor %}"
            ),
        }
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    template = ChatTemplate.from_dir(tmp_path)
    text, ids = template.encode([{"role": "user", "content": "hi"}])
    assert text == "<|begin_of_text|>[hi]"
    tok = Tokenizer.from_dir(tmp_path)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    with pytest.raises(ChatTemplateError, match="System role not supported"):
        template.render([{"role": "system", "content": "x"}])
    del cfg["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert ChatTemplate.from_dir(tmp_path) is None


async def test_tokenize_and_detokenize_as_vllm_answers_them(cluster, client):
    ids = cluster.tokenizer.encode("import os")
    r = await client.post(
        "/tokenize", json={"model": MODEL, "prompt": "import os", "add_special_tokens": False}
    )
    assert r.status_code == 200 and r.json() == {
        "count": len(ids),
        "max_model_len": MAX_MODEL_LEN,
        "tokens": ids,
        "token_strs": None,
    }
    r = await client.post("/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert r.json()["tokens"] == cluster.tokenizer.encode("<|user|>\nhi\n<|assistant|>\n")
    r = await client.post("/detokenize", json={"model": MODEL, "tokens": ids})
    assert r.json() == {"prompt": "import os"}
    r = await client.post("/detokenize", json={"model": MODEL, "tokens": [1, 10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


async def test_every_refusal_is_counted_once_in_request_failure_total(cluster, client):
    def failures() -> float:
        return (
            prometheus_client.REGISTRY.get_sample_value(
                "pdserve_request_failure_total", {"model_name": MODEL, "role": "coordinator", "code": "INVALID_ARGUMENT"}
            )
            or 0.0
        )

    before = failures()
    await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 17})  # refused by the front
    await client.post("/v1/completions", json={"model": MODEL})  # a body that does not parse
    await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "x", "top_p": 3}
    )  # by the request path
    await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "top_p": 3, "stream": True})
    assert failures() - before == 4


TEMPLATES = [
    # Llama 3 style: BOS written by the template, header tokens, trimmed content
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|start|>' + m['role'] + '<|end|>\\n\\n' + m['content'] | trim }}"
    "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|start|>assistant<|end|>\\n\\n{% endif %}",
    # tools/documents given as none, tojson, loop controls, transformers' {% generation %} blocks
    "{%- if tools is not none %}TOOLS{% endif %}"
    "{%- for m in messages %}{%- if m.role == 'system' %}{% continue %}"
    "{% endif %}{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
    "{% else %}{{ m | tojson }}\n{% endif %}{%- endfor %}{% if add_generation_prompt %}>>{% endif %}",
]


@pytest.mark.parametrize("template", TEMPLATES)
def test_chat_template_renders_and_tokenizes_as_transformers_does(tmp_path, model_dir, template):
    import transformers

    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((model_dir / name).read_bytes())
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    messages = [
        {"role": "system", "content": "Be brief. "},
        {"role": "user", "content": 'héllo "quoted" 你好'},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    hf_messages = [{**m, "content": "ab"} if isinstance(m["content"], list) else m for m in messages]
    text, ids = ChatTemplate.from_dir(tmp_path).encode(messages)
    assert text == hf.apply_chat_template(hf_messages, tokenize=False, add_generation_prompt=True)
    hf_ids = hf.apply_chat_template(hf_messages, tokenize=True, add_generation_prompt=True)
    assert ids == list(hf_ids["input_ids"] if isinstance(hf_ids, dict) or hasattr(hf_ids, "keys") else hf_ids)


TEXTS = ["x", ' "quoted" \\ back', "new\nline\ttab\r", "你好 😀 é", "\u2028\u2029", "\x00\x1f\x7f", "</script>"]


@pytest.mark.parametrize("kind, fields", [
    ("completion", {"prompt": "x"}),
    ("completion", {"prompt": "x", "n": 2, "stream_options": {"include_usage": True}}),
    ("chat", {"messages": [{"role": "user", "content": "x"}]}),
    ("chat", {"messages": [{"role": "user", "content": "x"}], "n": 3, "stream_options": {"include_usage": True}}),
])
def test_a_text_only_chunk_from_its_template_is_the_bytes_json_dumps_gives(kind, fields):
    """The SSE fast path (a chunk that only adds text, rendered from bytes made once per choice) writes
    exactly what the dict + json.dumps path writes, for every choice and any text."""
    front = Front(generation=None, model_name=MODEL, aliases=(), max_model_len=MAX_MODEL_LEN, chat=None,
                  ready=lambda: True)  # type: ignore[arg-type]
    body = (CompletionRequest if kind == "completion" else ChatRequest)(model=MODEL, stream=True, **fields)
    handler = Handler(front, kind, body, "id-1")
    assert handler.plain
    for index in range(body.n):
        template = handler.text_chunk(index)
        for text in TEXTS:
            expected = sse_event(handler.body([handler.choice(text, None, index=index)], None, True))
            assert template.render(text) == expected
            chunk = json.loads(expected[len(b"data: "):])
            assert chunk["choices"][0]["index"] == index


def test_logprobs_take_the_dict_path():
    front = Front(generation=None, model_name=MODEL, aliases=(), max_model_len=MAX_MODEL_LEN, chat=None,
                  ready=lambda: True)  # type: ignore[arg-type]
    assert not Handler(front, "completion", CompletionRequest(model=MODEL, prompt="x", logprobs=1), "i").plain
    assert not Handler(front, "chat", ChatRequest(model=MODEL, messages=[], logprobs=True), "i").plain
