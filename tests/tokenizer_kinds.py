"""The tokenizer kinds the tests build in-process (server/model/tiny.py's trainers, small vocabularies so
that most characters beyond ASCII are spelt in bytes): byte-level BPE, and SentencePiece-style byte fallback
as BPE and Unigram, with Llama 2's prepended-and-stripped space, Gemma's plain one, or a Metaspace
pre-tokenizer and decoder. Each `KINDS` value builds a fresh `tokenizers.Tokenizer`."""

from __future__ import annotations

SPECIAL = "<|im_end|>"
ADDED = ["hello world", "€uro", " ▁x"]
"""Added tokens that are not special: they stay in the text whatever skip_special_tokens says."""


def _byte_level():
    from pdserve.server.model.tiny import train_tokenizer

    return train_tokenizer(vocab_size=300)


def byte_fallback(**kwargs):
    from pdserve.server.model.tiny import train_byte_fallback_tokenizer

    return train_byte_fallback_tokenizer(vocab_size=400, **kwargs)


def _metaspace():
    """Byte fallback under a Metaspace pre-tokenizer (prepend_scheme "first") and a Metaspace decoder."""
    from tokenizers import decoders, pre_tokenizers

    tok = byte_fallback(strip_leading_space=False)
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Metaspace(prepend_scheme="first"), decoders.ByteFallback(),
                                     decoders.Fuse()])
    return tok


KINDS = {
    "byte-level": _byte_level,
    "byte-fallback-llama2": lambda: byte_fallback(),
    "byte-fallback-gemma": lambda: byte_fallback(strip_leading_space=False),
    "byte-fallback-unigram": lambda: byte_fallback(model="unigram"),
    "byte-fallback-metaspace": _metaspace,
}


def with_added(hf):
    """The tokenizer with SPECIAL and ADDED added."""
    hf.add_special_tokens([SPECIAL])
    hf.add_tokens(ADDED)
    return hf
