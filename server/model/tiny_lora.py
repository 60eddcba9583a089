"""Tiny PEFT LoRA adapters of a tiny checkpoint (`tiny.py`), for tests and demos: built with peft itself, so what
pdserve reads is what peft writes, and transformers + peft is the oracle of their tokens."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def make_tiny_lora(base_dir: str | Path, out_dir: str | Path, *, rank: int, targets: Sequence[str], seed: int = 0,
                   alpha: float | None = None, use_rslora: bool = False, std: float = 0.3) -> Path:
    """Writes a PEFT adapter (adapter_config.json + adapter_model.safetensors) of the checkpoint at base_dir to
    out_dir: rank `rank` on the projections `targets` (e.g. ("q_proj", "v_proj")), lora_alpha `alpha` (default
    2 rank), its A and B drawn from N(0, std) (not peft's zero B: the adapter must change the tokens)."""
    import peft
    import torch
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank if alpha is None else alpha, target_modules=list(targets),
                             lora_dropout=0.0, use_rslora=use_rslora, init_lora_weights=False)
    model = peft.get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, w in model.named_parameters():
            if "lora_" in name:
                w.copy_(torch.randn(w.shape, generator=generator) * std)
    out = Path(out_dir)
    model.save_pretrained(out)
    return out


def peft_greedy(base_dir: str | Path, adapter_dir: str | Path | None, prompt_ids: list[int],
                max_tokens: int) -> list[int]:
    """transformers' greedy tokens after prompt_ids with the adapter applied by peft (None: the base model's)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False,
                             min_new_tokens=max_tokens, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()
