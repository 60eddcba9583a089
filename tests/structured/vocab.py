"""A ten-token byte-level tokenizer whose ids a test can name: the masks of small grammars by hand."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from pdserve.server.structured.grammars import Grammars

VOCAB = {"<eos>": 0, "a": 1, "b": 2, "ab": 3, "{": 4, "}": 5, '"': 6, ":": 7, "1": 8, "x": 9}
EOS = 0
WIDTH = 40
"""The model's logits width: past the tokenizer's ten ids, padding."""


def tokenizer_json() -> str:
    tok = Tokenizer(models.BPE(VOCAB, [("a", "b")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    return tok.to_str()


def grammars(**kwargs) -> Grammars:
    return Grammars(tokenizer_json(), WIDTH, (EOS,), **kwargs)
