"""The grammar engine's vocabulary for every tokenizer kind the tests build (tests/tokenizer_kinds.py): a
choice, a regex and a JSON schema among non-ASCII strings, walked by random allowed tokens, give exactly
their text, byte fallback and Metaspace spacing included (llguidance's own tokenizer.json reading takes
a Metaspace "▁" for its UTF-8 bytes and refuses the tokens its own mask allowed)."""

from __future__ import annotations

import json
import random

import pytest

from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.server.model.token_bytes import token_bytes
from pdserve.server.structured.bitmask import allowed_ids, unconstrained
from pdserve.server.structured.grammars import Grammars
from pdserve.server.structured.lltokenizer import continuation
from tests.tokenizer_kinds import ADDED, KINDS, with_added

CHOICES = ["€", "中文", "😀", " x€", "a b", "hello world"]
PAD = 8
"""Logits wider than the tokenizer, as models pad their vocabulary."""


@pytest.fixture(scope="module", params=list(KINDS))
def hf(request):
    return with_added(KINDS[request.param]())


def eos_of(hf) -> int:
    return next(i for i in (hf.token_to_id("</s>"), hf.token_to_id("<|endoftext|>")) if i is not None)


def walk(hf, grammars: Grammars, spec: gen_pb.StructuredOutput, seed: int) -> list[int]:
    """Random allowed tokens until the grammar is done (or allows EOS and that is drawn)."""
    rng, width, eos = random.Random(seed), grammars.vocab_size, eos_of(hf)
    c = grammars.constraint(spec)
    ids: list[int] = []
    while not c.done:
        row = unconstrained(1, width)[0]
        c.fill(row)
        allowed = allowed_ids(row, width)
        assert allowed and max(allowed) < hf.get_vocab_size(), (ids, allowed)
        token = rng.choice(allowed)
        if token == eos:
            break
        assert c.advance(token), c.error
        ids.append(token)
        assert len(ids) < 64
    return ids


def in_context(hf, ids: list[int]) -> str:
    """The ids' text after other text (a decoder strips a leading space only at the start)."""
    anchor = hf.encode("a", add_special_tokens=False).ids
    return hf.decode(anchor + ids)[len(hf.decode(anchor)):]


def test_choice_regex_and_schema_give_exactly_their_text(hf):
    grammars = Grammars(hf.to_str(), hf.get_vocab_size() + PAD, (eos_of(hf),))
    specs = {
        "choice": (gen_pb.StructuredOutput(choice=gen_pb.Choices(choices=CHOICES)), set(CHOICES)),
        "regex": (gen_pb.StructuredOutput(regex="(€|中|😀){2}"), {a + b for a in "€中😀" for b in "€中😀"}),
        "json": (gen_pb.StructuredOutput(json_schema=json.dumps(
            {"type": "object", "properties": {"k": {"enum": ["中文", "😀"]}}, "required": ["k"],
             "additionalProperties": False})), {'{"k":"中文"}', '{"k":"😀"}'}),
    }
    for name, (spec, allowed) in specs.items():
        seen = {in_context(hf, walk(hf, grammars, spec, seed)) for seed in range(24)}
        assert seen <= allowed, (name, seen - allowed)
        assert len(seen) >= min(3, len(allowed)), (name, seen)


def test_every_tokens_bytes_are_its_text_in_context(hf):
    table = token_bytes(hf)
    grammars = Grammars(hf.to_str(), hf.get_vocab_size() + PAD, (eos_of(hf),))
    specials = {i for i, t in hf.get_added_tokens_decoder().items() if t.special}
    for i in range(hf.get_vocab_size()):
        if i in specials or table[i].startswith(b"\xff"):  # llguidance's special marker; never in UTF-8
            continue
        assert grammars.tokenizer.decode_bytes([i]) == table[i], (i, hf.id_to_token(i))
        text = table[i].decode("utf-8", errors="replace")
        if "\ufffd" not in text:
            assert in_context(hf, [i]) == text, (i, hf.id_to_token(i))


@pytest.mark.parametrize("text", ["€ 中文 😀", " x", "  lead and trail  ", "a\n\tb", *ADDED])
def test_continuation_tokenizes_text_to_its_own_bytes(hf, text):
    if "\u2581" in text and hf.token_to_id("<0x00>") is not None:
        text = text.replace("\u2581", " ")  # SentencePiece reads a "▁" in the text as a space
    table = token_bytes(hf)
    ids = continuation(hf).encode(text, add_special_tokens=False).ids
    assert b"".join(table[i] for i in ids) == text.encode()
