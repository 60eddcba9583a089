"""Writes small random-weight HF checkpoints, with a tokenizer trained in-process: byte-level BPE (GPT-2 /
Llama 3 / Qwen style), or SentencePiece-style BPE with byte fallback (Llama 2 / Mistral / Gemma style).

Used by the tests (through the real loading code) and as `pdserve up`'s default model.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path
from typing import Literal

Family = Literal["llama", "mistral", "qwen2", "qwen3", "mistral-windowed", "gemma2", "gemma3", "mixtral", "qwen3_moe",
                 "gemma2-defaults", "gemma3-softcapped", "deepseek_v2", "deepseek_v3"]
"""The checkpoints made here: one per served family, and "mistral-windowed", a Mistral whose every layer has
a sliding window of WINDOW tokens (prompts longer than it are a few words). The DeepSeeks (multi-head latent
attention, v_head_dim unlike the qk heads', a dense first layer then 8 routed experts, 2 per token, and shared
experts): "deepseek_v3" with q_lora_rank, YaRN (mscale != mscale_all_dim: both YaRN factors count),
sigmoid routing limited to 2 of 4 groups with a non-zero correction bias; "deepseek_v2" without q_lora_rank,
softmax greedy routing, interleaved RoPE. The Gemmas alternate windowed
(local) and global layers with the same window, over 4 layers. The MoEs have 8 experts, 2 per token
(Mixtral renormalises the two; this Qwen3-MoE does not: norm_topk_prob false).

Two Gemmas check soft-capping, their scores and logits made large (`_sharpened`) so that each cap changes the
logits (Gemma 2's attention cap, the greedy tokens too): "gemma2-defaults", whose config.json omits both soft-caps (transformers' Gemma2Config applies
50 and 30), and "gemma3-softcapped", a Gemma 3 that sets final_logit_softcapping 15."""

OMITTED: dict[str, tuple[str, ...]] = {"gemma2-defaults": ("attn_logit_softcapping", "final_logit_softcapping")}
"""The fields a checkpoint's config.json leaves out (its family's transformers defaults apply)."""

WINDOW = 24

EOS = "<|endoftext|>"
BOS = "<|begin_of_text|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Small, but with head_dim 32 (what vLLM's CPU attention accepts) and GQA (4 q heads, 2 kv heads).
_SHAPE = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    initializer_range=0.05,
)


def training_text(max_chars: int = 400_000) -> str:
    """Python standard-library sources: text that lies on every machine with Python."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="ignore")
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "".join(parts)[:max_chars]


def train_tokenizer(vocab_size: int = 512):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, BOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = training_text()
    lines = text.splitlines(keepends=True)
    tok.train_from_iterator(lines, trainer=trainer)
    return tok


TokenizerKind = Literal["byte-level", "byte-fallback"]
"""byte-level: `train_tokenizer`'s (EOS, BOS as above). byte-fallback: `train_byte_fallback_tokenizer`'s,
Llama 2's layout (<unk>, <s>, </s>, then the 256 `<0xXX>` byte pieces; BOS added by tokenizer_config)."""

SP_UNK, SP_BOS, SP_EOS = "<unk>", "<s>", "</s>"
SPACE = "\u2581"
"""SentencePiece's "▁", the space inside pieces."""


def train_byte_fallback_tokenizer(vocab_size: int = 512, *, strip_leading_space: bool = True,
                                  model: Literal["bpe", "unigram"] = "bpe"):
    """A SentencePiece-style tokenizer with byte fallback, as HF converts Llama 2's (`strip_leading_space`:
    a "▁" is prepended to the text and its decoder strips one leading space) or Gemma's (spaces become
    "▁", nothing prepended or stripped). Its pieces come from the same sources as `train_tokenizer`'s,
    which hold few characters beyond ASCII, so most others are spelt in `<0xXX>` byte pieces."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    specials = [SP_UNK, SP_BOS, SP_EOS]
    if model == "bpe":
        tok = Tokenizer(models.BPE(unk_token=SP_UNK, byte_fallback=True, fuse_unk=True))
        trainer = trainers.BpeTrainer(vocab_size=vocab_size - 256, special_tokens=specials, limit_alphabet=100,
                                      show_progress=False)
    else:
        tok = Tokenizer(models.Unigram())
        trainer = trainers.UnigramTrainer(vocab_size=vocab_size - 256, special_tokens=specials, unk_token=SP_UNK,
                                          max_piece_length=8, shrinking_factor=0.5, show_progress=False)
    replace = normalizers.Replace(" ", SPACE)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), replace]) if strip_leading_space else replace
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if strip_leading_space else []))
    text = training_text(200_000 if model == "bpe" else 30_000)  # Unigram trains slower
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    return _with_byte_pieces(tok)


def _with_byte_pieces(tok):
    """The trained tokenizer with the 256 `<0xXX>` pieces put after the special tokens, as Llama 2 has them
    (the trainers do not make them)."""
    from tokenizers import Tokenizer

    state = json.loads(tok.to_str())
    m = state["model"]
    pieces = [f"<0x{b:02X}>" for b in range(256)]
    if m["type"] == "BPE":
        old = sorted(m["vocab"], key=m["vocab"].__getitem__)
        order = old[:3] + pieces + [t for t in old[3:] if t not in pieces]
        m["vocab"] = {t: i for i, t in enumerate(order)}
    else:  # Unigram: [piece, score] pairs; the byte pieces score lowest, taken only where nothing else fits
        low = min(score for _, score in m["vocab"]) - 1.0
        m["vocab"] = m["vocab"][:3] + [[p, low] for p in pieces] + [v for v in m["vocab"][3:] if v[0] not in pieces]
        m["unk_id"], m["byte_fallback"] = 0, True
    return Tokenizer.from_str(json.dumps(state))


DRAFT_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=1, head_dim=32)
"""A smaller checkpoint of the same tokenizer (`make_tiny_model(..., shape=DRAFT_SHAPE)`): a draft model for
draft_model speculation."""


def _hf_config(family: Family, vocab_size: int, eos_id: int, bos_id: int, shape: dict | None = None):
    import transformers

    common = dict(_SHAPE, **(shape or {}), vocab_size=vocab_size, eos_token_id=eos_id, bos_token_id=bos_id)
    if family == "llama":
        # Llama 3.2-style: llama3 rope scaling and tied embeddings.
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return transformers.LlamaConfig(**common, tie_word_embeddings=True, rope_parameters=rope)
    if family == "mistral":
        return transformers.MistralConfig(**common, sliding_window=None, rope_theta=10000.0)
    if family == "mistral-windowed":
        return transformers.MistralConfig(**common, sliding_window=WINDOW, rope_theta=10000.0)
    if family == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1000000.0)
    if family == "qwen3":
        return transformers.Qwen3Config(**common, tie_word_embeddings=False, rope_theta=1000000.0)
    if family == "mixtral":
        # 4 kv heads: a prefill mesh of 4 devices splits it (heads and experts both)
        return transformers.MixtralConfig(**dict(common, num_key_value_heads=4), num_local_experts=8,
                                          num_experts_per_tok=2, rope_theta=1e6, sliding_window=None)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                           norm_topk_prob=False, rope_theta=1e6, tie_word_embeddings=False)
    gemma = dict(common, num_hidden_layers=(shape or {}).get("num_hidden_layers", 4), sliding_window=WINDOW,
                 query_pre_attn_scalar=24,
                 hidden_activation="gelu_pytorch_tanh")
    if family == "gemma2":  # local, global, local, global; both soft-caps (Gemma 2's 50 and 30 are far off here)
        return transformers.Gemma2Config(**gemma, attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
    if family == "gemma2-defaults":  # Gemma2Config's own caps, 50 and 30
        return transformers.Gemma2Config(**gemma)
    if family in ("gemma3", "gemma3-softcapped"):  # layers 0-2 local (their own rope theta), 3 global; qk-norm
        rope = {"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
        types = ["sliding_attention"] * 3 + ["full_attention"]
        caps = {"final_logit_softcapping": 15.0} if family == "gemma3-softcapped" else {}
        return transformers.Gemma3TextConfig(**gemma, layer_types=types, rope_parameters=rope, **caps)
    if family in ("deepseek_v2", "deepseek_v3"):
        mla = dict(common, num_hidden_layers=(shape or {}).get("num_hidden_layers", 3), num_key_value_heads=4,
                   kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=8,
                   num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1)
        mla.pop("head_dim")  # transformers sets it to qk_rope_head_dim
        if family == "deepseek_v2":
            return transformers.DeepseekV2Config(**mla, q_lora_rank=None, n_shared_experts=2, topk_method="greedy",
                                                 rope_theta=10000.0)
        yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.7,
                "original_max_position_embeddings": mla["max_position_embeddings"] // 4}
        return transformers.DeepseekV3Config(**mla, q_lora_rank=48, n_shared_experts=1, n_group=4, topk_group=2,
                                             norm_topk_prob=True, routed_scaling_factor=2.5, rope_parameters=yarn)
    raise ValueError(f"unknown family {family!r}; choose one of {', '.join(Family.__args__)}")


def _sharpened(model) -> None:
    """Scores and logits made several times larger, where a Gemma's soft-caps change them: the q and k
    projections scaled by 4 (Gemma 2; Gemma 3's qk-norm would undo it), the final norm's scale by 12."""
    import torch

    with torch.no_grad():
        for name, w in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")) and model.config.model_type == "gemma2":
                w.mul_(4)
            elif name == "model.norm.weight":
                w.copy_(12 * (1 + w) - 1)  # Gemma's norms scale by (1 + w)


def make_tiny_model(
    out_dir: str | Path,
    family: Family = "llama",
    *,
    dtype: Literal["float32", "bfloat16"] = "float32",
    seed: int = 0,
    max_shard_size: str | None = None,
    shape: dict | None = None,
    tokenizer: TokenizerKind = "byte-level",
) -> Path:
    """Writes config, safetensors weights, tokenizer and generation config to out_dir. shape: config keys that
    replace the tiny shape's (DRAFT_SHAPE: a smaller model of the same tokenizer); tokenizer: which kind
    (`TokenizerKind`)."""
    try:
        import torch
        import transformers
    except ImportError as e:  # pragma: no cover - depends on the install
        raise SystemExit(f"make-tiny-model needs torch and transformers: pip install 'pdserve[dev]' ({e})")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    byte_fallback = tokenizer == "byte-fallback"
    tok = train_byte_fallback_tokenizer() if byte_fallback else train_tokenizer()
    eos, bos = (SP_EOS, SP_BOS) if byte_fallback else (EOS, BOS)
    eos_id, bos_id = tok.token_to_id(eos), tok.token_to_id(bos)
    config = _hf_config(family, tok.get_vocab_size(), eos_id, bos_id, shape)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if family.startswith("gemma"):  # its norms start at w = 0, (1 + w) = 1: made random so that every one counts
        with torch.no_grad():
            for name, w in model.named_parameters():
                if "norm" in name:
                    w.normal_(0.0, 0.2)
            if family in OMITTED or family == "gemma3-softcapped":
                _sharpened(model)
    if family == "deepseek_v3":  # a correction bias that changes which experts are chosen
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.normal_(0.0, 0.5)
    model = model.to(getattr(torch, dtype)).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    if family in OMITTED:
        raw = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if k not in OMITTED[family]},
                                                    indent=2))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": eos,
                "bos_token": bos,
                "add_bos_token": byte_fallback,
                "model_max_length": _SHAPE["max_position_embeddings"],
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos_id, "bos_token_id": bos_id, "do_sample": False}, indent=2)
    )
    return out
