"""Trains a small Llama in-process on the Python standard library's sources; saves an HF checkpoint.

Random weights give flat next-token distributions; this model's are peaked like a real one's, so the
accuracy harness can tell what quantization does to a model that has learned something. It is also
`pdserve up`'s embedded default model (server/model/default/), so the demo writes plausible Python.

    .venv/bin/python -m pdserve.benchmarks.train_tiny --out /tmp/tiny --minutes 14
    .venv/bin/python -m pdserve.benchmarks.train_tiny --init /tmp/tiny --out server/model/default --minutes 34 --lr 3e-3

(how the committed model was made, on 2 shared CPU cores: 799 steps of 16 x 128 tokens, held-out
perplexity 19.6; `training.json` beside the weights records it). Training runs for wall-clock minutes,
so a faster machine makes more steps from the same command.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import transformers

from pdserve.server.model.tiny import BOS, CHAT_TEMPLATE, EOS, train_tokenizer, training_text

SHAPE = dict(  # ~2.5M parameters (5 MB in bf16)
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=True,
)


def token_stream(tok, max_chars: int) -> np.ndarray:
    ids = tok.encode(training_text(max_chars)).ids
    return np.asarray(ids, dtype=np.int64)  # [N]


def train(out: Path, *, minutes: float, seq_len: int, batch_size: int, lr: float, max_chars: int,
          seed: int, dtype: str, init: Path | None = None, shape: dict = SHAPE) -> dict:
    """Trains for `minutes` of wall time (from `init`'s weights when given) and saves to `out`."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    tok = train_tokenizer()
    eos_id, bos_id = tok.token_to_id(EOS), tok.token_to_id(BOS)
    data = token_stream(tok, max_chars)
    held_out = data[-20_000:]  # the last stretch is never trained on
    data = data[:-20_000]
    config = transformers.LlamaConfig(**shape, vocab_size=tok.get_vocab_size(), eos_token_id=eos_id,
                                      bos_token_id=bos_id)
    previous = {}
    if init is not None:  # continue a checkpoint this script wrote
        model = transformers.LlamaForCausalLM.from_pretrained(init, dtype=torch.float32)
        if (init / "training.json").exists():
            previous = json.loads((init / "training.json").read_text())
    else:
        model = transformers.LlamaForCausalLM(config)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    budget = minutes * 60
    t0 = time.monotonic()
    step, losses = 0, []
    while (elapsed := time.monotonic() - t0) < budget:
        frac = elapsed / budget
        for group in opt.param_groups:  # warm up 3 %, then cosine to 10 %
            group["lr"] = lr * min(1.0, frac / 0.03) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        starts = rng.integers(0, len(data) - seq_len - 1, size=batch_size)
        batch = torch.from_numpy(np.stack([data[s : s + seq_len] for s in starts]))  # [B, S]
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        step += 1
        if step % 50 == 0:
            print(f"step {step} loss {np.mean(losses[-50:]):.3f} ({elapsed:.0f} s)", flush=True)
    model.eval()
    with torch.no_grad():
        chunks = torch.from_numpy(held_out[: (len(held_out) // seq_len) * seq_len].reshape(-1, seq_len))
        held_loss = float(np.mean([model(input_ids=c[None], labels=c[None]).loss.item() for c in chunks]))
    save(model.to(getattr(torch, dtype)), tok, out, eos_id, bos_id)
    steps = step + previous.get("steps", 0)
    stats = {"steps": steps, "tokens_seen": step * batch_size * seq_len + previous.get("tokens_seen", 0), "train_loss": float(np.mean(losses[-50:])),
             "held_out_loss": held_loss, "held_out_ppl": math.exp(held_loss),
             "minutes": minutes + previous.get("minutes", 0),
             "params": sum(p.numel() for p in model.parameters()), "dtype": dtype}
    (out / "training.json").write_text(json.dumps(stats, indent=2) + "\n")
    return stats


def save(model, tok, out: Path, eos_id: int, bos_id: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "bos_token": BOS,
        "add_bos_token": False, "model_max_length": SHAPE["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos_id, "bos_token_id": bos_id, "do_sample": False}, indent=2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("server/model/default"))
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--max-chars", type=int, default=3_000_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--init", type=Path, help="continue training this checkpoint (written by this script)")
    p.add_argument("--hidden-size", type=int, default=SHAPE["hidden_size"])
    p.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    p.add_argument("--intermediate-size", type=int, default=SHAPE["intermediate_size"])
    p.add_argument("--heads", type=int, default=SHAPE["num_attention_heads"])
    p.add_argument("--kv-heads", type=int, default=SHAPE["num_key_value_heads"])
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    stats = train(args.out, minutes=args.minutes, seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr,
                  max_chars=args.max_chars, seed=args.seed, dtype=args.dtype, init=args.init,
                  shape=SHAPE | dict(hidden_size=args.hidden_size, num_hidden_layers=args.layers,
                                     intermediate_size=args.intermediate_size, num_attention_heads=args.heads,
                                     num_key_value_heads=args.kv_heads))
    print(json.dumps(stats, indent=2))


if __name__ == "__main__":
    main()
