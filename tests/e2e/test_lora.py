"""LoRA adapters through `pdserve up --enable-lora` (2 prefill + 2 decode workers) and the openai SDK, as vLLM
serves them: a concurrent batch mixing the base model and two adapters (ranks 8 and 16, different target modules)
gives each request transformers + peft's greedy tokens, every prompt prefilled by the prefill tier (the decode
workers compute none); an adapter loaded at runtime serves, unloaded it is a 404; bad adapters are refused at load
while the server serves on."""

from __future__ import annotations

import asyncio
import json

import urllib.request

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.server.launcher import free_port
from pdserve.server.model.tiny_lora import make_tiny_lora, peft_greedy
from tests.e2e.cluster import pdserve_up, wait_all_blocks_free

MAX_TOKENS = 8
PROMPTS = {"base": [5, 17, 33, 41, 9, 12, 100, 7], "ada": [60, 61, 62, 3, 4, 5, 200, 201, 9],
           "bob": [11, 22, 33, 44, 55, 66, 77], "cy": [300, 301, 2, 3, 99, 7, 8]}


@pytest.fixture(scope="module")
def cluster(tiny_loras, tmp_path_factory):
    base, loras = tiny_loras
    http_port = free_port()
    bob = json.dumps({"name": "bob", "path": str(loras["bob"]), "base_model_name": base.name})
    args = ["--http-port", str(http_port), "--enable-lora", "--lora-modules", f"ada={loras['ada']}", bob,
            "--max-loras", "2", "--max-cpu-loras", "2", "--max-lora-rank", "16"]
    with pdserve_up(base, tmp_path_factory.mktemp("up"), prefill_workers=2, decode_workers=2, extra_args=args,
                    env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}) as state:
        state["http"] = f"http://127.0.0.1:{http_port}"
        yield state


@pytest.fixture(autouse=True)
def no_leaked_blocks(cluster):
    yield
    pairs = wait_all_blocks_free(cluster["decode"])
    assert all(free == total for free, total in pairs), f"leaked KV blocks (free, total): {pairs}"


async def _complete(sdk: openai.AsyncOpenAI, model: str, prompt: list[int]):
    return await sdk.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})


def _computed_tokens(cluster) -> dict[str, float]:
    """Prompt tokens each tier's workers computed (pdserve_prefill_computed_tokens_total: a prefill worker's, or a
    decode worker's local prefill), summed over the tier."""
    out = {"prefill": 0.0, "decode": 0.0}
    for name, address in cluster["metrics"].items():
        tier = name.split("-")[0]
        if tier in out:
            text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
            out[tier] += sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
                             if s.name == "pdserve_prefill_computed_tokens_total")
    return out


def _sdk(cluster) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{cluster['http']}/v1", api_key="unused", max_retries=0, timeout=120)


async def test_a_concurrent_mixed_batch_gives_each_request_peft_tokens(cluster, tiny_loras):
    base, loras = tiny_loras
    before = _computed_tokens(cluster)
    async with _sdk(cluster) as sdk:
        models = {m.id: m for m in (await sdk.models.list()).data}
        assert set(models) == {base.name, "ada", "bob"}
        assert (models["ada"].root, models["ada"].parent) == (str(loras["ada"]), base.name)
        assert (models["bob"].root, models["bob"].parent) == (str(loras["bob"]), base.name)
        names = ["base", "ada", "bob", "ada", "bob", "base"]
        answers = await asyncio.gather(*(_complete(sdk, base.name if n == "base" else n, PROMPTS[n]) for n in names))
    for name, answer in zip(names, answers):
        assert answer.model == (base.name if name == "base" else name)
        expected = peft_greedy(base, None if name == "base" else loras[name], PROMPTS[name], MAX_TOKENS)
        assert answer.usage.completion_tokens == MAX_TOKENS
        assert _token_ids(answer) == expected, name
        assert answer.choices[0].prompt_token_ids == PROMPTS[name]
    after = _computed_tokens(cluster)  # the prefill tier computed every prompt, the adapters' too
    assert after["decode"] == before["decode"] == 0
    assert after["prefill"] - before["prefill"] == sum(len(PROMPTS[n]) for n in names)  # none is a full block


def _token_ids(answer) -> list[int]:
    return answer.choices[0].token_ids


async def test_an_adapter_loaded_at_runtime_serves_until_unloaded(cluster, tiny_loras):
    base, loras = tiny_loras
    http = cluster["http"]
    async with httpx.AsyncClient(base_url=http, timeout=120) as client, _sdk(cluster) as sdk:
        r = await client.post("/v1/load_lora_adapter", json={"lora_name": "cy", "lora_path": str(loras["cy"])})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'cy' added successfully."
        again = await client.post("/v1/load_lora_adapter", json={"lora_name": "cy", "lora_path": str(loras["cy"])})
        assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]
        answers = await asyncio.gather(_complete(sdk, "cy", PROMPTS["cy"]), _complete(sdk, "ada", PROMPTS["ada"]),
                                       _complete(sdk, base.name, PROMPTS["base"]))
        for name, answer in zip(("cy", "ada", "base"), answers):
            expected = peft_greedy(base, None if name == "base" else loras[name], PROMPTS[name], MAX_TOKENS)
            assert _token_ids(answer) == expected, name
        r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "cy"})
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'cy' removed successfully."
        with pytest.raises(openai.NotFoundError) as gone:
            await _complete(sdk, "cy", PROMPTS["cy"])
        error = gone.value.body
        assert error["type"] == "NotFoundError" and error["message"] == "The model `cy` does not exist."
        r = await client.post("/v1/unload_lora_adapter", json={"lora_name": "cy"})
        assert r.status_code == 404 and r.json()["error"]["message"] == "The lora adapter 'cy' cannot be found."
        assert "cy" not in {m.id for m in (await sdk.models.list()).data}


async def test_bad_adapters_are_refused_at_load_and_the_server_serves_on(cluster, tiny_loras, tmp_path):
    from pdserve.server.model.tiny import DRAFT_SHAPE, make_tiny_model

    base, loras = tiny_loras
    other_base = make_tiny_model(tmp_path / "other", "llama", shape=DRAFT_SHAPE)
    wrong_base = make_tiny_lora(other_base, tmp_path / "wrong-base", rank=8, targets=("q_proj",))
    too_big = make_tiny_lora(base, tmp_path / "too-big", rank=32, targets=("v_proj",))
    async with httpx.AsyncClient(base_url=cluster["http"], timeout=120) as client, _sdk(cluster) as sdk:
        missing = await client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
        assert missing.status_code == 404
        assert missing.json()["error"]["message"] == f"Loading lora x failed: No adapter found for {tmp_path}"
        wrong = await client.post("/v1/load_lora_adapter", json={"lora_name": "w", "lora_path": str(wrong_base)})
        assert wrong.status_code == 400 and "trained on another base model" in wrong.json()["error"]["message"]
        big = await client.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(too_big)})
        assert big.status_code == 400 and "--max-lora-rank 32" in big.json()["error"]["message"]
        with pytest.raises(openai.NotFoundError):
            await _complete(sdk, "w", PROMPTS["base"])
        answer = await _complete(sdk, "ada", PROMPTS["ada"])
        assert _token_ids(answer) == peft_greedy(base, loras["ada"], PROMPTS["ada"], MAX_TOKENS)


def test_grpc_and_kserve_take_the_adapter_by_name(cluster, tiny_loras):
    """pdserve.v1's `lora_name` and KServe's `model_name` select an adapter; an unknown one is NOT_FOUND."""
    import grpc
    import numpy as np
    import tritonclient.grpc as triton_grpc

    from pdserve.server.client import build_request, stream
    from pdserve.server.model.tokenizer import Tokenizer

    base, loras = tiny_loras
    request = build_request(token_ids=PROMPTS["bob"], max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    request.lora_name = "bob"
    got = [t for r in stream(cluster["coordinator"], request, timeout=120) for t in r.token_ids]
    expected = peft_greedy(base, loras["bob"], PROMPTS["bob"], MAX_TOKENS)
    assert got == expected
    request.lora_name = "nobody"
    with pytest.raises(grpc.RpcError) as e:
        list(stream(cluster["coordinator"], request, timeout=120))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "The model `nobody` does not exist." in e.value.details()

    tokenizer = Tokenizer.from_dir(base)
    prompt = tokenizer.decode(PROMPTS["ada"], skip_special_tokens=False)
    ids = tokenizer.encode(prompt)  # what the server tokenizes the text to
    client = triton_grpc.InferenceServerClient(cluster["coordinator"])
    try:
        assert client.is_model_ready("ada")
        text_input = triton_grpc.InferInput("text_input", [1], "BYTES")
        text_input.set_data_from_numpy(np.array([prompt.encode()], dtype=object))
        sampling = triton_grpc.InferInput("sampling_parameters", [1], "BYTES")
        params = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        sampling.set_data_from_numpy(np.array([json.dumps(params).encode()], dtype=object))
        result = client.infer("ada", [text_input, sampling])
        text = result.as_numpy("text_output")[0].decode()
        assert result.get_response().model_name == "ada"
        expected_text = tokenizer.decode(peft_greedy(base, loras["ada"], ids, MAX_TOKENS))
        assert text.endswith(expected_text)
    finally:
        client.close()


async def test_a_streamed_chat_with_an_adapter_carries_its_name_and_token_ids(cluster, tiny_loras):
    base, loras = tiny_loras
    async with _sdk(cluster) as sdk:
        chunks = [c async for c in await sdk.chat.completions.create(
            model="bob", messages=[{"role": "user", "content": "hello there"}], max_tokens=MAX_TOKENS, temperature=0,
            stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})]
    assert {c.model for c in chunks} == {"bob"}
    prompt = chunks[0].prompt_token_ids
    assert prompt and all(getattr(c, "prompt_token_ids", None) is None for c in chunks[1:])
    got = [t for c in chunks for choice in c.choices for t in (choice.token_ids or [])]
    assert got == peft_greedy(base, loras["bob"], prompt, MAX_TOKENS)
