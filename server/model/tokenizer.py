"""The model's tokenizer: an HF `tokenizer.json` (through `tokenizers`) plus `tokenizer_config.json`."""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HfTokenizer

from pdserve.server.model.config import ModelLoadError
from pdserve.server.model.token_bytes import BYTE_PIECE, Unsupported, decoder_steps, token_bytes


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return data


GIL_FREE_CHARS = 4096
"""Longer texts are encoded with `encode_batch`, which releases the GIL (`encode` holds it throughout: a
1 MB prompt tokenized in a thread still stalled the coordinator's event loop ~1 s)."""


class Tokenizer:
    """Text <-> token ids. Adds BOS only when tokenizer_config.json says `add_bos_token: true`."""

    def __init__(
        self,
        tokenizer: HfTokenizer,
        *,
        add_bos_token: bool = False,
        bos_token_id: int | None = None,
        eos_token_ids: tuple[int, ...] = (),
    ):
        if add_bos_token and bos_token_id is None:
            raise ModelLoadError("add_bos_token is true but the tokenizer has no BOS token")
        self._tok = tokenizer
        self.add_bos_token = add_bos_token
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise ModelLoadError(
                f"{path} is missing: pdserve needs a fast (tokenizers) tokenizer.json beside the weights; "
                f"copy the checkpoint's own, or write one from a slow tokenizer (tokenizer.model) with "
                f"transformers: AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)"
            )
        try:
            tok = HfTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise ModelLoadError(f"{path} is not a valid tokenizer.json: {e}") from e
        cfg = _read_json(model_dir / "tokenizer_config.json")
        gen = _read_json(model_dir / "generation_config.json")

        def token_id(value: Any) -> int | None:
            content = _token_content(value)
            return tok.token_to_id(content) if content is not None else None

        bos = token_id(cfg.get("bos_token"))
        if bos is None and isinstance(gen.get("bos_token_id"), int):
            bos = gen["bos_token_id"]
        eos: list[int] = []
        first_eos = token_id(cfg.get("eos_token"))
        if first_eos is not None:
            eos.append(first_eos)
        gen_eos = gen.get("eos_token_id")
        for e in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
            if isinstance(e, int) and e not in eos:
                eos.append(e)
        return cls(
            tok,
            add_bos_token=bool(cfg.get("add_bos_token", False)),
            bos_token_id=bos,
            eos_token_ids=tuple(eos),
        )

    @property
    def hf(self) -> HfTokenizer:
        """The `tokenizers.Tokenizer` itself."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows, added tokens included (the model's embedding may be larger)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        # The tokenizer's own post-processor adds what the checkpoint declares (Llama 3's BOS);
        # `add_bos_token` in tokenizer_config.json asks for a BOS on top when it is not there yet.
        if len(text) > GIL_FREE_CHARS:  # encode_batch releases the GIL: a thread running it leaves the loop free
            ids = self._tok.encode_batch([text], add_special_tokens=True)[0].ids
        else:
            ids = self._tok.encode(text, add_special_tokens=True).ids
        if self.add_bos_token and (not ids or ids[0] != self.bos_token_id):
            assert self.bos_token_id is not None
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @cached_property
    def byte_pieces(self) -> dict[int, int]:
        """The ids the decoder reads as one byte each, and their byte (`<0xXX>` under a ByteFallback
        decoder: Llama 2, Mistral, Gemma); empty for byte-level BPE, whose every token is bytes already."""
        if not any(step.get("type") == "ByteFallback" for step in decoder_steps(self._tok)):
            return {}
        vocab = self._tok.get_vocab(with_added_tokens=True)
        return {i: int(m.group(1), 16) for t, i in vocab.items() if (m := BYTE_PIECE.fullmatch(t))}

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids of the special added tokens: what `decode(..., skip_special_tokens=True)` drops."""
        return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    @cached_property
    def token_bytes(self) -> list[bytes] | None:
        """Each id's bytes, as it stands in the middle of a text (server/model/token_bytes.py); None when
        the decoder is not one read there."""
        try:
            return token_bytes(self._tok)
        except Unsupported:
            return None

    def token_text(self, token_id: int) -> str:
        """One token's own text, as logprobs name it: its bytes as UTF-8 (U+FFFD for a part of a character;
        SentencePiece's "▁" a space even at the start), a special token's content."""
        table = self.token_bytes
        if table is None or not 0 <= token_id < len(table):
            return self.decode([token_id], skip_special_tokens=False)
        return table[token_id].decode("utf-8", errors="replace")

    def max_token_bytes(self) -> int | None:
        """An upper bound on the UTF-8 bytes of text one token stands for, or None when the tokenizer
        normalizes (normalizing may shrink text, so no bound holds). A token's vocabulary string is never
        shorter in UTF-8 than the text it encodes (byte-level, SentencePiece and byte-fallback pieces)."""
        if self._tok.normalizer is not None:
            return None
        return max((len(t.encode()) for t in self._tok.get_vocab(with_added_tokens=True)), default=None)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)
