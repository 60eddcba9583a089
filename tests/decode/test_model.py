"""Parity of the torch decode model with transformers, for every family, over a paged cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

from pdserve.kvcache.layout import KvLayout
from pdserve.server.decode.kv_cache import PagedKvCache
from pdserve.server.decode.model import DecoderModel
from pdserve.server.decode.weights import build_model
from pdserve.server.model.config import load_config, parse_config
from pdserve.server.model.weights import load_weights

TOL = 1e-4
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def models(family_model):
    """(HF fp32 model, our fp32 model) for one family."""
    _, path = family_model
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = load_config(path)
    return hf, build_model(config, load_weights(path))


def _cache(model: DecoderModel, block_size: int, num_blocks: int, dtype: str = "float32") -> PagedKvCache:
    c = model.config
    return PagedKvCache(KvLayout(c.num_layers, c.num_kv_heads, c.head_dim, block_size, dtype), num_blocks)


def _prompt(length: int, seed: int, vocab: int = 512) -> torch.Tensor:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed))  # int64 [S]


def _hf_kv(hf, prompt: torch.Tensor) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """HF's last logits [V] and its KV cache as numpy [L, S, Hkv, D] (what the prefill tier sends)."""
    with torch.no_grad():
        out = hf(prompt[None], use_cache=True)
    cache = out.cache if "cache" in out else out.past_key_values  # transformers 5.24 renamed it `cache`
    assert cache.layers[0].keys.shape == (1, hf.config.num_key_value_heads, len(prompt), hf.config.head_dim)
    k = torch.stack([layer.keys[0].transpose(0, 1) for layer in cache.layers])  # [L, S, Hkv, D]
    v = torch.stack([layer.values[0].transpose(0, 1) for layer in cache.layers])
    return out.logits[0, -1], k.numpy(), v.numpy()


@pytest.mark.parametrize("block_size, table", [(4, [7, 2, 11]), (16, [5])])
def test_prefill_matches_hf(models, block_size, table):
    hf, model = models
    prompt = _prompt(12, seed=0)
    cache = _cache(model, block_size, num_blocks=12)
    logits = model.prefill(prompt, table, cache)
    with torch.no_grad():
        expected = hf(prompt[None]).logits[0]
    assert logits.dtype == torch.float32 and logits.shape == (12, model.config.vocab_size)
    assert (logits - expected).abs().max() < TOL
    # The cache now holds HF's post-RoPE K and V in the table's blocks: what the prefill tier would send.
    _, k_hf, v_hf = _hf_kv(hf, prompt)
    k, v = cache.read(table, 12)
    assert (k - torch.from_numpy(k_hf)).abs().max() < TOL
    assert (v - torch.from_numpy(v_hf)).abs().max() < TOL
    others = [b for b in range(12) if b not in table]
    assert not cache.k[:, others].any()


def test_chunked_prefill_continues_from_start_pos(models):
    hf, model = models
    prompt = _prompt(19, seed=1)
    table = [9, 0, 4, 6, 1]
    cache = _cache(model, 4, num_blocks=10)
    first = model.prefill(prompt[:7], table, cache)
    second = model.prefill(prompt[7:], table, cache, start_pos=7)
    with torch.no_grad():
        expected = hf(prompt[None]).logits[0]
    assert (torch.cat([first, second]) - expected).abs().max() < TOL


def test_disaggregated_decode_matches_hf_generate(models):
    hf, model = models
    block_size = 4
    prompts = [_prompt(n, seed=10 + n) for n in (5, 12, 9)]
    blocks = iter(np.random.default_rng(0).permutation(40).tolist())
    tables = [[next(blocks) for _ in range(-(-(len(p) + NEW_TOKENS) // block_size))] for p in prompts]
    cache = _cache(model, block_size, num_blocks=40)

    tokens: list[list[int]] = []
    for prompt, table in zip(prompts, tables):
        last_logits, k, v = _hf_kv(hf, prompt)
        cache.write(table, 0, 0, k, v)
        tokens.append([int(last_logits.argmax())])  # the prefill tier samples the first token

    # Pad each row with blocks of the other sequences: masking must keep them out.
    width = max(map(len, tables))
    block_tables = torch.tensor([t + tables[0][: width - len(t)] for t in tables])  # [B, M]
    lengths = torch.tensor([len(p) for p in prompts])
    step_logits = []
    for step in range(NEW_TOKENS - 1):
        positions = lengths + step
        last = torch.tensor([t[-1] for t in tokens])
        logits = model.decode(last, positions, block_tables, positions + 1, cache)  # [B, V]
        step_logits.append(logits)
        for row, token in enumerate(logits.argmax(-1).tolist()):
            tokens[row].append(token)

    for row, prompt in enumerate(prompts):
        generated = hf.generate(
            prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            do_sample=False, max_new_tokens=NEW_TOKENS,
        )[0, len(prompt):].tolist()
        assert tokens[row] == generated
        with torch.no_grad():
            full = hf(torch.tensor([prompt.tolist() + tokens[row]])).logits[0]  # [P + 8, V]
        for step, logits in enumerate(step_logits):
            assert (logits[row] - full[len(prompt) + step]).abs().max() < TOL, (row, step)


def test_bfloat16_checkpoint_stays_close_to_hf_bfloat16(tiny_model):
    path = tiny_model("llama", "bfloat16")
    config = load_config(path)
    assert config.dtype == "bfloat16"
    model = build_model(config, load_weights(path), dtype=torch.bfloat16)
    cache = _cache(model, 4, num_blocks=8, dtype="bfloat16")
    prompt = _prompt(12, seed=2)
    table = [3, 6, 0, 5, 1]

    logits = [model.prefill(prompt, table, cache)]  # [12, V]
    tokens = prompt.tolist() + [int(logits[0][-1].argmax())]
    for position in range(12, 19):
        step = model.decode(torch.tensor(tokens[-1:]), torch.tensor([position]), torch.tensor([table]),
                            torch.tensor([position + 1]), cache)
        logits.append(step)
        tokens.append(int(step[0].argmax()))
    ours = torch.cat(logits)  # [19, V]
    with torch.no_grad():
        hf_bf16 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        hf_fp32 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        expected = hf_bf16(torch.tensor([tokens])).logits[0, :19].float()
        exact = hf_fp32(torch.tensor([tokens])).logits[0, :19]
    # Logits come out of a bf16 matmul: the same ops in another order differ by bf16 ulps of the largest
    # logit. Measured: exactly 1 ulp (2**-6 at |logits| ~2-3) for 4 prompts x 2 families; allow 2.
    ulp = 2.0 ** (torch.floor(torch.log2(expected.abs().max())).item() - 7)
    assert (ours - expected).abs().max() <= 2 * ulp
    # Against fp32 we are as accurate as transformers' own bf16 (measured ratio 0.82-1.07).
    assert (ours - exact).abs().max() <= 1.5 * (expected - exact).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_transformers_rotate_half_bit_for_bit(dtype):
    """q and k are roped together with a roll and a signed sin: the same bits as HF's rotate_half form."""
    from transformers.models.llama.modeling_llama import rotate_half

    from pdserve.server.decode.model import rope, rope_tables
    from pdserve.server.model.rope import inv_freq

    config = parse_config(dict(architectures=["LlamaForCausalLM"], hidden_size=64, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=128, num_hidden_layers=1, vocab_size=32,
                               rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=4096))
    positions = torch.tensor([[0, 1, 517], [3, 2048, 4095]])  # [B, S]
    x = torch.randn(2, 3, 6, 16, generator=torch.Generator().manual_seed(0)).to(dtype)  # [B, S, H + Hkv, D]
    cos, sin = rope_tables(positions, torch.from_numpy(inv_freq(config)), dtype)  # [B, S, 1, D]
    freqs = positions[..., None].float() * torch.from_numpy(inv_freq(config)).float()
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None]  # HF's cos/sin
    expected = x * emb.cos().to(dtype) + rotate_half(x) * emb.sin().to(dtype)
    assert torch.equal(rope(x, cos, sin), expected)
