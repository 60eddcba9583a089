"""Accuracy of each quantization setting against fp32, through the disaggregated numerics, in-process.

For each (prefill weights, decode weights, KV dtype) the text runs exactly as it does in a cluster,
minus the network: the JAX prefill tier computes the prompt (padded to its bucket), quantizes the KV
on the device to the decode worker's format with per-block, per-head scales, the torch decode tier
stores those bytes and scales in its paged cache as they are and decodes from them. Against the
fp32 pipeline (fp32 weights on both tiers, fp32 KV) on the same checkpoint and the same fixed text:

- mean KL(p_fp32 || p_setting) of the next-token distributions, teacher-forced over the text,
- top-1 agreement: how often both pick the same next token,
- greedy agreement: how many greedy tokens from each prompt match fp32's before the first difference,
- perplexity of the fixed text (a stretch of the Python standard library).

    .venv/bin/python -m pdserve.benchmarks.engine.accuracy                       # both models, writes benchmarks/results/
    .venv/bin/python -m pdserve.benchmarks.engine.accuracy --models trained --prompts 4   # quicker

Models: `trained` is the embedded default model (server/model/default, made by benchmarks.train_tiny),
whose distributions are peaked like a real model's; `qwen-shape` is a random-weight model of
Qwen2.5-0.5B's shape (hidden 896, 14 q / 2 kv heads of 64, intermediate 4864, vocab 151936, tied
embeddings; `--qwen-layers` of its 24 layers), built once into the cache directory. Random weights
give flat distributions, where small errors flip the top-1 often: read its agreement as a lower bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch

from pdserve.benchmarks.paths import EMBEDDED_MODEL
from pdserve.kvcache.layout import NUMPY_DTYPES, QUANTIZED, KvLayout
from pdserve.server.decode.kv_cache import TORCH_DTYPES, PagedKvCache
from pdserve.server.decode.weights import build_model
from pdserve.server.model.config import load_config
from pdserve.server.model.weights import load_weights
from pdserve.server.prefill.model import compute_dtype, load_params, make_prefill_fn
from pdserve.server.prefill.shapes import bucket_length
from pdserve.server.prefill.quant import WEIGHT_FORMATS, quantize_kv
from pdserve.server.cache_dir import cache_dir

Setting = tuple[str, str, str]  # (prefill weights, decode weights, KV dtype)
BASELINE: Setting = ("float32", "float32", "float32")
SETTINGS: list[Setting] = [
    ("bfloat16", "bfloat16", "bfloat16"),
    ("float32", "float32", "bfloat16"),
    ("float32", "float32", "int8"),
    ("float32", "float32", "fp8_e4m3"),
    ("int8", "int8", "float32"),
    ("fp8", "fp8", "float32"),
    ("int8", "int8", "int8"),
    ("fp8", "fp8", "fp8_e4m3"),
    ("int8", "fp8", "fp8_e4m3"),
]
DEFAULT_MODEL = EMBEDDED_MODEL
QWEN_SHAPE = dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
                  vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, initializer_range=0.02)


class Pipeline:
    """One setting's two tiers over one checkpoint: JAX prefill -> quantized KV -> torch decode."""

    def __init__(self, model_dir: Path, setting: Setting, block_size: int = 16, fp32_compute: bool = False):
        """fp32_compute: int8/fp8 weights compute in fp32 whatever the checkpoint's dtype (the workers
        compute in the checkpoint's), so that a row measures the quantization alone."""
        prefill_weights, decode_weights, kv_dtype = setting
        self.config = config = load_config(model_dir)
        if fp32_compute:
            config = dataclasses.replace(config, dtype="float32")
        weights = load_weights(model_dir)
        self.params = load_params(config, weights, prefill_weights)
        self.prefill_fn = make_prefill_fn(config)
        self.kv_dtype = kv_dtype
        quantized = decode_weights in WEIGHT_FORMATS
        dtype = TORCH_DTYPES[compute_dtype(config, decode_weights)]
        self.decoder = build_model(config, weights, dtype, weight_format=decode_weights if quantized else None)
        del weights
        self.layout = KvLayout.of(config.num_layers, config.num_kv_heads, config.head_dim, block_size, kv_dtype)
        self.max_len = 1 << (config.max_model_len - 1).bit_length()

    def prefill(self, prompts: np.ndarray, table_blocks: int) -> tuple[torch.Tensor, PagedKvCache, torch.Tensor]:
        """prompts int [N, P] -> (logits f32 [N, V] at the last prompt token, the filled cache, tables [N, M]).

        The prompts are padded to the prefill bucket as the engine pads them; the KV of the true length
        travels in the wire format, quantized on the device, and is written as it came.
        """
        n, p = prompts.shape
        rows = 1 << (n - 1).bit_length()
        tokens = np.zeros((rows, bucket_length(p, self.max_len)), np.int32)
        tokens[:n, :p] = prompts
        lengths = np.full((rows,), p, np.int32)
        logits, k, v = self.prefill_fn(self.params, tokens, lengths)  # [B, V], [L, B, S, Hkv, D]
        cache = PagedKvCache(self.layout, n * table_blocks)
        tables = torch.arange(n * table_blocks).reshape(n, table_blocks)  # [N, M]
        bs = self.layout.block_size
        if self.kv_dtype in QUANTIZED:
            (qk, ks), (qv, vs) = (jax.device_get(quantize_kv(x, jnp.asarray(lengths), bs, self.kv_dtype)) for x in (k, v))
            for i in range(n):
                nb = -(-p // bs)
                cache.write(tables[i].tolist(), 0, 0, qk[:, i, :p], qv[:, i, :p], ks[:, i, :nb], vs[:, i, :nb])
        else:
            wire = NUMPY_DTYPES[self.kv_dtype]
            hk, hv = np.asarray(k.astype(wire)), np.asarray(v.astype(wire))
            for i in range(n):
                cache.write(tables[i].tolist(), 0, 0, hk[:, i, :p], hv[:, i, :p])
        return torch.from_numpy(np.asarray(logits)[:n].copy()), cache, tables

    def decode(self, cache: PagedKvCache, tables: torch.Tensor, tokens: torch.Tensor, position: int) -> torch.Tensor:
        """One step for every row: tokens [N] at `position` -> logits f32 [N, V]."""
        positions = torch.full((tokens.shape[0],), position, dtype=torch.int64)
        return self.decoder.decode(tokens, positions, tables, positions + 1, cache).float()

    def teacher_forced(self, prompts: np.ndarray, text: np.ndarray) -> torch.Tensor:
        """Log-probs f32 [N, C, V] of the next token before each of text's C tokens (prefill predicts the first)."""
        n, p = prompts.shape
        c = text.shape[1]
        logits, cache, tables = self.prefill(prompts, self.layout.num_blocks(p + c))
        out = [torch.log_softmax(logits, -1)]
        for t in range(c - 1):
            out.append(torch.log_softmax(self.decode(cache, tables, torch.from_numpy(text[:, t]), p + t), -1))
        return torch.stack(out, 1)

    def greedy(self, prompts: np.ndarray, steps: int) -> np.ndarray:
        """Greedy tokens int [N, steps]: the first from prefill, the rest from decode (as a cluster runs it)."""
        n, p = prompts.shape
        logits, cache, tables = self.prefill(prompts, self.layout.num_blocks(p + steps - 1))
        tokens = [logits.argmax(-1)]
        for t in range(steps - 1):
            tokens.append(self.decode(cache, tables, tokens[-1], p + t).argmax(-1))
        return torch.stack(tokens, 1).numpy()


@dataclass
class Row:
    setting: Setting
    mean_kl: float
    top1_agreement: float
    greedy_agreement: float
    """Mean greedy tokens equal to fp32's before the first difference (of `greedy_steps`)."""
    perplexity: float
    seconds: float


def fixed_text(tokenizer_dir: Path, num: int, length: int) -> np.ndarray:
    """num rows of length tokens from a fixed stretch of the standard library that training never saw."""
    from tokenizers import Tokenizer

    from pdserve.server.model.tiny import training_text

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    ids = tok.encode(training_text(3_000_000)[-60_000:]).ids  # the tail: train_tiny holds it out
    ids = np.asarray(ids[-num * length:], dtype=np.int64)
    if len(ids) < num * length:
        raise ValueError(f"the fixed text has {len(ids)} tokens; {num} x {length} are needed")
    return ids.reshape(num, length)


def evaluate(model_dir: Path, text: np.ndarray, prompt_len: int, greedy_steps: int,
             settings: list[Setting], log=print) -> list[Row]:
    prompts, cont = text[:, :prompt_len], text[:, prompt_len:]
    rows, ref = [], None
    for setting in [BASELINE, *settings]:
        t0 = time.perf_counter()
        pipe = Pipeline(model_dir, setting, fp32_compute=True)
        logp = pipe.teacher_forced(prompts, cont)  # [N, C, V]
        greedy = pipe.greedy(prompts, greedy_steps)  # [N, G]
        del pipe
        gc.collect()
        nll = -logp.gather(-1, torch.from_numpy(cont)[..., None]).mean().item()
        if ref is None:
            ref = (logp, greedy)
        ref_logp, ref_greedy = ref
        kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1).mean().item()
        top1 = (ref_logp.argmax(-1) == logp.argmax(-1)).float().mean().item()
        same = np.cumprod(greedy == ref_greedy, axis=1).sum(axis=1).mean()
        row = Row(setting, kl, top1, float(same), math.exp(nll), time.perf_counter() - t0)
        rows.append(row)
        log(f"  {' / '.join(setting):32s} KL {kl:.5f}  top-1 {top1:.3f}  greedy {same:.1f}/{greedy_steps}  "
            f"ppl {row.perplexity:.2f}  ({row.seconds:.0f} s)")
    return rows


def make_qwen_shape(out: Path, layers: int) -> Path:
    """A random-weight fp32 Qwen2 checkpoint of Qwen2.5-0.5B's shape (the tiny tokenizer; ids < 512 used)."""
    if (out / "config.json").exists():
        return out
    import transformers

    from pdserve.server.model.tiny import EOS, train_tokenizer

    tmp = out.with_suffix(".partial")
    tok = train_tokenizer()
    config = transformers.Qwen2Config(**QWEN_SHAPE, num_hidden_layers=layers, eos_token_id=tok.token_to_id(EOS))
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).eval()
    model.save_pretrained(tmp)
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                           "eos_token": EOS}))
    tmp.rename(out)
    return out


def markdown(results: dict) -> str:
    lines = []
    for name, entry in results["models"].items():
        lines += [f"**{name}** — {entry['description']}", "",
                  "| prefill weights | decode weights | KV | mean KL | top-1 agreement | greedy agreement "
                  f"(of {entry.get('greedy_steps', results['greedy_steps'])}) | perplexity |",
                  "|---|---|---|---|---|---|---|"]
        for r in entry["rows"]:
            p, d, kv = r["setting"]
            lines.append(f"| {p} | {d} | {kv} | {r['mean_kl']:.5f} | {r['top1_agreement']:.3f} | "
                         f"{r['greedy_agreement']:.1f} | {r['perplexity']:.2f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", choices=["trained", "qwen-shape"], default=["trained", "qwen-shape"])
    p.add_argument("--trained-model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--qwen-layers", type=int, default=24, help="layers of the Qwen2.5-0.5B-shaped model (24 is its own)")
    p.add_argument("--prompts", type=int, default=8, help="rows of the fixed text")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--text-len", type=int, default=32, help="tokens scored after each prompt")
    p.add_argument("--greedy-steps", type=int, default=32)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--cache", type=Path, default=cache_dir())
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    results = {"command": "python -m pdserve.benchmarks.engine.accuracy " + " ".join(argv if argv is not None else sys.argv[1:]),
               "prompts": args.prompts, "prompt_len": args.prompt_len, "text_len": args.text_len,
               "greedy_steps": args.greedy_steps, "baseline": list(BASELINE), "models": {}}
    text = fixed_text(args.trained_model, args.prompts, args.prompt_len + args.text_len)
    for name in args.models:
        if name == "trained":
            model_dir = args.trained_model
            stats = json.loads((model_dir / "training.json").read_text()) if (model_dir / "training.json").exists() else {}
            c = load_config(model_dir)
            description = (f"the embedded default model: a Llama of {c.num_layers} layers, hidden {c.hidden_size}, "
                           f"trained in-process on stdlib sources by benchmarks.train_tiny "
                           f"({stats.get('steps', '?')} steps, held-out perplexity {stats.get('held_out_ppl', float('nan')):.1f})")
        else:
            model_dir = make_qwen_shape(args.cache / "models" / f"qwen2.5-0.5b-shape-{args.qwen_layers}l", args.qwen_layers)
            description = (f"random weights, Qwen2.5-0.5B's shape with {args.qwen_layers} of its 24 layers "
                           f"(flat distributions: a lower bound on agreement)")
        print(f"{name}: {description}", flush=True)
        rows = evaluate(model_dir, text, args.prompt_len, args.greedy_steps, SETTINGS,
                        log=lambda s: print(s, flush=True))
        results["models"][name] = {"description": description, "model_dir": str(model_dir),
                                   "greedy_steps": args.greedy_steps, "positions": args.prompts * args.text_len,
                                   "rows": [r.__dict__ | {"setting": list(r.setting)} for r in rows]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "accuracy.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "accuracy.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
