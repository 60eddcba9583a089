"""A byte-fallback vocabulary served end to end (`pdserve up`, a tiny llama whose tokenizer spells most
characters in `<0xXX>` pieces, as Llama 2, Mistral and Gemma do): streamed text is exactly the decode of the
ids, and a structured `choice` among non-ASCII strings answers exactly the string chosen."""

from __future__ import annotations

import openai
import pytest

from pdserve.server.launcher import free_port
from pdserve.server.model.tokenizer import Tokenizer
from tests.e2e.cluster import pdserve_up
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.server.client import build_request, stream

CHOICES = ["€", "中文", "😀"]


@pytest.fixture(scope="module")
def cluster(tiny_byte_fallback_model, tmp_path_factory):
    http_port = free_port()
    with pdserve_up(tiny_byte_fallback_model, tmp_path_factory.mktemp("up"), prefill_workers=1, decode_workers=1,
                    extra_args=["--http-port", str(http_port)]) as state:
        state["http"] = f"http://127.0.0.1:{http_port}"
        state["model"] = tiny_byte_fallback_model.name
        state["tokenizer"] = Tokenizer.from_dir(tiny_byte_fallback_model)
        yield state


def test_greedy_stream_is_the_decode_of_its_ids(cluster):
    tok: Tokenizer = cluster["tokenizer"]
    prompt = tok.encode("Grüße, 世界 😀:")
    assert tok.byte_pieces.keys() & set(prompt)
    texts, ids = [], []
    for m in stream(cluster["coordinator"], build_request(token_ids=prompt, max_tokens=64, temperature=0.0, ignore_eos=True), timeout=60):
        texts.append(m.text)
        ids.extend(m.token_ids)
    assert len(ids) == 64 and tok.byte_pieces.keys() & set(ids)  # the random model spells in bytes too
    before = tok.decode(prompt)
    whole = tok.decode(prompt + ids)
    assert whole.startswith(before)
    assert "".join(texts) == whole[len(before):]
    for text in texts:
        text.encode("utf-8")


def test_sampled_non_ascii_streams_exactly_the_decode_of_its_ids(cluster):
    """A regex holds the output to characters spelt in byte pieces, so the text really is byte runs."""
    tok: Tokenizer = cluster["tokenizer"]
    prompt = tok.encode("Say:")
    for seed in range(3):
        req = gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=prompt), sampling=gen_pb.SamplingParams(
            max_tokens=60, temperature=1.0, seed=seed, structured=gen_pb.StructuredOutput(regex="[€中文😀 ]{6,12}")))
        texts, ids = [], []
        for m in stream(cluster["coordinator"], req, timeout=60):
            texts.append(m.text)
            ids.extend(m.token_ids)
        ids = [i for i in ids if i not in tok.eos_token_ids]
        assert sum(i in tok.byte_pieces for i in ids) >= 6
        text = tok.decode(prompt + ids)[len(tok.decode(prompt)):]
        assert "".join(texts) == text and "\ufffd" not in text, (seed, texts, ids)
        assert 6 <= len(text) <= 12 and set(text) <= set("€中文😀 ")


@pytest.mark.parametrize("endpoint, stream_", [("completions", False), ("completions", True), ("chat", True)])
def test_choice_among_non_ascii_strings_answers_exactly_one(cluster, endpoint, stream_):
    with openai.OpenAI(base_url=f"{cluster['http']}/v1", api_key="unused", max_retries=0, timeout=120) as sdk:
        for seed in range(4):
            common = dict(model=cluster["model"], temperature=1.0, seed=seed, max_tokens=16, stream=stream_,
                          extra_body={"structured_outputs": {"choice": CHOICES}})
            if endpoint == "chat":
                out = sdk.chat.completions.create(messages=[{"role": "user", "content": "Pick one."}], **common)
            else:
                out = sdk.completions.create(prompt="Pick one:", **common)
            if not stream_:
                text, finish = out.choices[0].text, out.choices[0].finish_reason
            else:
                chunks = [c.choices[0] for c in out if c.choices]
                pieces = [(c.delta.content or "") if endpoint == "chat" else c.text for c in chunks]
                text, finish = "".join(pieces), chunks[-1].finish_reason
            assert (text, finish) in {(c, "stop") for c in CHOICES}, (seed, text, finish)
