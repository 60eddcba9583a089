"""Whether a draft checkpoint can propose for the served model (draft_model speculation), checked at start
(`DecodeConfig` runs it, so `pdserve up` and `pdserve decode` refuse before anything starts; no torch here).

A draft proposes token ids the target verifies, so both must mean the same thing by every id: the same vocab
size in config.json and the same tokenizer.json (its vocabulary, merges, added tokens, normalizer and
pre-tokenizer). The draft may be of any family the native engine serves and of any size.
"""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.server.model.config import ModelConfig, ModelLoadError, load_config

_TOKENIZER_PARTS = ("model", "added_tokens", "normalizer", "pre_tokenizer", "post_processor", "decoder")
"""The parts of tokenizer.json that decide which id a text is (or a token id's text)."""


def check_draft_checkpoint(target_dir: str | Path, draft_dir: str | Path, max_model_len: int | None = None
                           ) -> ModelConfig:
    """The draft's config; ValueError naming `model` and what differs from the target when it cannot draft.
    max_model_len: the served one (None: the target's own), which the draft's positions must reach."""
    where = f"--speculative-config: model {str(draft_dir)!r}"
    try:
        draft = load_config(draft_dir)
    except ModelLoadError as e:
        raise ValueError(f"{where} is not a checkpoint the native decode engine serves: {e}") from e
    target = load_config(target_dir)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"{where}: the draft's vocab_size {draft.vocab_size} differs from the served model's "
                         f"{target.vocab_size} ({target_dir}); a draft must share the served model's tokenizer")
    served = min(target.max_model_len, max_model_len or target.max_model_len)
    if draft.max_model_len < served:
        raise ValueError(f"{where}: the draft's positions end at {draft.max_model_len}, before the served "
                         f"max_model_len {served}; serve a shorter --max-model-len or a draft that reaches it")
    problem = tokenizer_difference(Path(target_dir) / "tokenizer.json", Path(draft_dir) / "tokenizer.json")
    if problem:
        raise ValueError(f"{where}: its tokenizer differs from the served model's ({target_dir}): {problem}; a "
                         f"draft must share the served model's tokenizer")
    return draft


def tokenizer_difference(target: Path, draft: Path) -> str | None:
    """What differs between two tokenizer.json files (None: nothing that changes an id, or neither exists)."""
    if not target.exists() and not draft.exists():
        return None  # a random-shape checkpoint without a tokenizer: ids are all there is, and the sizes agree
    if not target.exists() or not draft.exists():
        return f"{target if not target.exists() else draft} is missing (the other has one)"
    a, b = (json.loads(p.read_text()) for p in (target, draft))
    for part in _TOKENIZER_PARTS:
        if a.get(part) == b.get(part):
            continue
        if part == "model" and isinstance(a.get(part), dict) and isinstance(b.get(part), dict):
            va, vb = a[part].get("vocab"), b[part].get("vocab")
            if isinstance(va, dict) and isinstance(vb, dict) and va != vb:
                moved = sorted(t for t in set(va) | set(vb) if va.get(t) != vb.get(t))
                return (f"{len(moved)} vocabulary entries differ (e.g. {moved[0]!r}: id {va.get(moved[0])} in the "
                        f"served model's, {vb.get(moved[0])} in the draft's)")
            return "the tokenizer model (merges or type) differs"
        return f"tokenizer.json's {part!r} differs"
    return None
