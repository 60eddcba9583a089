"""A random-weight checkpoint of Qwen2.5-0.5B's shape, for benchmarks both pdserve and vLLM can serve.

The tokenizer is made, not downloaded: a byte-level BPE whose 151,936 entries (Qwen2.5's vocab size)
are two specials, the 94 printable ASCII characters, all 8,836 pairs of them and then triples, so every
token id the random model can emit decodes to printable ASCII (no partial UTF-8 for a detokenizer to
hold back). Benchmarks send prompts as token ids, so its merges never matter for timing.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Literal

VOCAB_SIZE = 151936
EOS, BOS = "<|endoftext|>", "<|im_start|>"

QWEN25_05B = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=32768,
    rope_theta=1e6,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
)


def ascii_bpe_tokenizer(vocab_size: int = VOCAB_SIZE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = [chr(c) for c in range(0x21, 0x7F)]  # '!'..'~': byte-level maps them to themselves
    vocab: dict[str, int] = {EOS: 0, BOS: 1}
    merges: list[tuple[str, str]] = []
    for c in chars:
        vocab[c] = len(vocab)
    for a, b in itertools.product(chars, repeat=2):
        vocab[a + b] = len(vocab)
        merges.append((a, b))
    for a, b, c in itertools.product(chars, repeat=3):
        if len(vocab) == vocab_size:
            break
        vocab[a + b + c] = len(vocab)
        merges.append((a + b, c))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS, BOS])
    return tok


def make_qwen25_05b_shape(
    out_dir: str | Path,
    dtype: Literal["float32", "bfloat16"] = "bfloat16",
    seed: int = 0,
    num_hidden_layers: int | None = None,
) -> Path:
    """Writes config, safetensors, tokenizer and generation config; returns out_dir. Idempotent."""
    import torch
    import transformers

    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    shape = dict(QWEN25_05B, eos_token_id=0, bos_token_id=1)
    if num_hidden_layers:
        shape["num_hidden_layers"] = num_hidden_layers
    config = transformers.Qwen2Config(**shape, initializer_range=0.02)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(getattr(torch, dtype)).eval().save_pretrained(tmp)
    ascii_bpe_tokenizer().save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": EOS,
                "bos_token": BOS,
                "add_bos_token": False,
                "model_max_length": shape["max_position_embeddings"],
            },
            indent=2,
        )
    )
    (tmp / "generation_config.json").write_text(
        json.dumps({"eos_token_id": 0, "bos_token_id": 1, "do_sample": False}, indent=2)
    )
    tmp.rename(out)
    return out


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out", type=Path)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    a = p.parse_args()
    print(make_qwen25_05b_shape(a.out, a.dtype))
