"""Each token's bytes and own text (server/model/token_bytes.py, `Tokenizer.token_text`), for every tokenizer
kind the tests build: joined, a text's tokens give its bytes exactly, as decode gives them after other text."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.v1 import generation_pb2
from pdserve.server.coordinator.openai.logprobs import chat_logprobs
from pdserve.server.model.token_bytes import Unsupported, token_bytes
from pdserve.server.model.tokenizer import Tokenizer
from tests.tokenizer_kinds import KINDS, SPECIAL, byte_fallback, with_added


@pytest.fixture(scope="module", params=list(KINDS))
def tok(request) -> Tokenizer:
    return Tokenizer(with_added(KINDS[request.param]()))


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\u2581"), max_size=20))
def test_a_texts_token_bytes_join_to_its_decode_after_other_text(tok, text):
    anchor = tok.hf.encode("a", add_special_tokens=False).ids
    ids = tok.hf.encode(text, add_special_tokens=False).ids
    joined = b"".join(tok.token_bytes[i] for i in ids)
    assert joined.decode() == tok.decode(anchor + ids)[len(tok.decode(anchor)):]


def test_token_text_keeps_sentencepiece_spaces_and_names_special_tokens():
    tok = Tokenizer(with_added(byte_fallback()))
    ids = tok.hf.encode("x:  return self, 😀", add_special_tokens=False).ids
    pieces = [tok.hf.id_to_token(i) for i in ids]
    assert "<0xF0>" in pieces and "\u2581\u2581" in pieces and "return\u2581" in pieces
    for i, piece in zip(ids, pieces):
        if piece.startswith("<0x"):
            assert tok.token_bytes[i] == bytes([int(piece[3:5], 16)]) and tok.token_text(i) == "\ufffd"
        else:
            assert tok.token_text(i) == piece.replace("\u2581", " ")
    assert tok.token_text(tok.hf.token_to_id(SPECIAL)) == SPECIAL
    assert tok.token_text(tok.hf.token_to_id("</s>")) == "</s>"


def test_chat_logprobs_bytes_of_a_character_spelt_in_byte_pieces_join_to_it():
    tok = Tokenizer(byte_fallback())
    ids = tok.hf.encode("😀", add_special_tokens=False).ids[1:]  # after the "▁"
    assert len(ids) == 4
    entries = [generation_pb2.TokenLogprob(token_id=i, logprob=-1.0) for i in ids]
    content = chat_logprobs(entries, tok.token_text, lambda i: tok.token_bytes[i])["content"]
    assert bytes(b for item in content for b in item["bytes"]).decode() == "😀"
    assert [item["token"] for item in content] == ["\ufffd"] * 4


def test_other_decoders_are_not_read():
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import decoders, models

    hf = HfTokenizer(models.WordPiece({"[UNK]": 0, "ab": 1, "##c": 2}, unk_token="[UNK]"))
    hf.decoder = decoders.WordPiece()
    with pytest.raises(Unsupported, match="WordPiece"):
        token_bytes(hf)
    tok = Tokenizer(hf)
    assert tok.token_bytes is None and tok.token_text(1) == "ab"
