"""The grammar engine's vocabulary (llguidance's LLTokenizer), from the model's tokenizer.json.

llguidance reads a tokenizer.json itself, but only a ByteLevel decoder or a Sequence holding ByteFallback
with a Replace of the space: under a Metaspace decoder (a SentencePiece tokenizer converted with
prepend_scheme) it takes "▁" for its UTF-8 bytes, so masks and text disagree and a sampled token is
refused ("decode step failed"), and it drops the space in front of an added token. Here it gets each token's
bytes as `tokenizers` decodes it in the middle of a text (server/model/token_bytes.py, the table logprobs
use), the special tokens by id, and the tokenizer to tokenize forced text with, as a continuation: without
the "▁" that SentencePiece's normalizer (Prepend) or pre-tokenizer (Metaspace's prepend scheme) puts in front
of a text, which would make a choice's " x" two spaces. A decoder not read there goes to llguidance's own
reading as before.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
from tokenizers import Tokenizer

from pdserve.server.model.token_bytes import Unsupported, token_bytes


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads: eos/bos ids, each token's bytes, the special ids, and
    text -> ids (called with str only: llguidance tokenizes what is not whole UTF-8 itself)."""

    def __init__(self, hf: Tokenizer, tokens: list[bytes], eos_ids: tuple[int, ...]):
        self._hf = hf
        self.tokens = tokens
        self.special_token_ids = sorted(i for i, t in hf.get_added_tokens_decoder().items()
                                        if t.special and i < len(tokens))
        self.eos_token_id = eos_ids[0] if eos_ids else (self.special_token_ids or [0])[0]
        self.bos_token_id = None

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text, not bytes")
        return self._hf.encode(text, add_special_tokens=False).ids


def continuation(hf: Tokenizer) -> Tokenizer:
    """The tokenizer without what it puts in front of a whole text: Prepend normalizers dropped, Metaspace
    pre-tokenizers' prepend scheme "never". An added token that is matched after normalizing keeps the
    form the whole text's normalizer gave it (its bytes), matched as is."""
    state = json.loads(hf.to_str())
    for added in state.get("added_tokens") or []:
        if added.get("normalized") and not added.get("special"):
            added["content"], added["normalized"] = hf.id_to_token(added["id"]), False

    def fix(part: Any) -> Any:
        if not isinstance(part, dict):
            return part
        if part.get("type") == "Prepend":
            return None
        if part.get("type") == "Metaspace":
            part = {**part, "prepend_scheme": "never", "add_prefix_space": False}
        for key in ("normalizers", "pretokenizers"):
            if isinstance(part.get(key), list):
                part = {**part, key: [p for p in map(fix, part[key]) if p is not None]}
        return part

    state["normalizer"] = fix(state.get("normalizer"))
    state["pre_tokenizer"] = fix(state.get("pre_tokenizer"))
    state["post_processor"] = None
    return Tokenizer.from_str(json.dumps(state))


def ll_tokenizer(tokenizer_json: str, n_vocab: int, eos_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    """The LLTokenizer of a tokenizer.json for logits `n_vocab` wide (ids past the tokenizer's are never
    allowed); eos_ids: what a complete grammar allows next."""
    eos = list(eos_ids) or None
    hf = Tokenizer.from_str(tokenizer_json)
    try:
        tokens = token_bytes(hf)[:n_vocab]
    except Unsupported:
        return llguidance.LLTokenizer(tokenizer_json, n_vocab=n_vocab, eos_token=eos)
    tokens += [b""] * (n_vocab - len(tokens))  # the logits' padding: empty tokens, never allowed
    vocabulary = _Vocabulary(continuation(hf), tokens, eos_ids)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocabulary), n_vocab=n_vocab, eos_token=eos)
