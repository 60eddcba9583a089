"""Each token's bytes: the text a token stands for in the middle of a text, read off the tokenizer's decoder.

Built once per tokenizer (`token_bytes`), for what needs a token on its own: logprobs' token strings and
bytes, and the grammar engine's vocabulary (server/structured/lltokenizer.py). The decoders the served
families use are read as `tokenizers` applies them to a token that is not the first:

- ByteLevel (GPT-2, Llama 3, Qwen): each character stands for one byte (its byte-decoder table); a token
  with a character outside the table (an added token) is its own UTF-8.
- ByteFallback (Llama 2, Mistral, Gemma: SentencePiece): `<0xXX>` is the byte XX; other pieces are their
  UTF-8 after the decoder's Replace steps (or Metaspace's) turn "▁" into a space. Strip and Metaspace's
  prepend scheme only touch the first token of a decode, so they do not apply here.
- Metaspace alone (SentencePiece without byte fallback): "▁" is a space.

Special tokens are their content. Other decoders (WordPiece, CTC, ...) are `Unsupported`.
"""

from __future__ import annotations

import json
import re
from typing import Any

BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
"""SentencePiece's byte-fallback pieces, as tokenizers' ByteFallback decoder reads them."""


class Unsupported(ValueError):
    """The tokenizer's decoder is none of those read here."""


def decoder_steps(hf: Any) -> list[dict[str, Any]]:
    """The decoder's steps in order (a Sequence's members; [] without a decoder), from its JSON state."""
    if hf.decoder is None:
        return []
    state = json.loads(hf.decoder.__getstate__())
    return list(state.get("decoders") or []) if state.get("type") == "Sequence" else [state]


def _byte_decoder() -> dict[str, int]:
    """GPT-2's table: the printable character that stands for each byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_bytes(hf: Any) -> list[bytes]:
    """Every id's bytes (ids up to the tokenizer's size, added tokens included); Unsupported when the
    decoder is none of those read here."""
    steps = decoder_steps(hf)
    types = {s.get("type") for s in steps}
    size = hf.get_vocab_size(with_added_tokens=True)
    tokens = [hf.id_to_token(i) or "" for i in range(size)]
    special = {i for i, t in hf.get_added_tokens_decoder().items() if t.special}
    if "ByteLevel" in types:
        table = _byte_decoder()

        def one(token: str) -> bytes:
            try:
                return bytes(table[c] for c in token)
            except KeyError:
                return token.encode()
    elif "ByteFallback" in types or "Metaspace" in types:
        replaces = []
        for s in steps:
            if s.get("type") == "Replace" and "String" in s.get("pattern", {}):
                replaces.append((s["pattern"]["String"], s["content"]))
            elif s.get("type") == "Metaspace":
                replaces.append((s.get("replacement", "\u2581"), " "))
        byte_fallback = "ByteFallback" in types

        def one(token: str) -> bytes:
            m = BYTE_PIECE.fullmatch(token) if byte_fallback else None
            if m:
                return bytes([int(m.group(1), 16)])
            for pattern, content in replaces:
                token = token.replace(pattern, content)
            return token.encode()
    else:
        raise Unsupported(f"the tokenizer's decoder ({', '.join(sorted(map(str, types))) or 'none'}) is not "
                          f"ByteLevel, ByteFallback or Metaspace")
    return [t.encode() if i in special else one(t) for i, t in enumerate(tokens)]
