"""DeepSeek-V2/V3 on the decode tier (multi-head latent attention over a cache of latents, absorbed
projections; DeepSeek's routing): greedy tokens, cached latents and routing against transformers."""

from __future__ import annotations

import asyncio

import pytest
import torch

from pdserve.kvcache.layout import KvLayout
from pdserve.server.decode.engine import DecodeEngine
from pdserve.server.decode.kv_cache import PagedKvCache
from pdserve.server.decode.moe import route
from pdserve.server.decode.weights import build_model
from pdserve.server.model.config import load_config
from pdserve.server.model.weights import load_weights

from .test_engine import _admit, _all_back, _drain, _hf_greedy

DEEPSEEK = ["deepseek_v3", "deepseek_v2"]
PROMPTS = [[5, 17, 99, 3, 250, 11, 42, 7, 8, 300, 301, 2, 9], [40, 41, 42], list(range(100, 131))]


def _engine(path, block_size: int = 4, kv_dtype: str = "float32") -> DecodeEngine:
    config = load_config(path)
    layout = KvLayout.for_model(config, block_size, kv_dtype)
    return DecodeEngine(build_model(config, load_weights(path)), layout, num_blocks=64, max_running=4)


@pytest.mark.parametrize("family", DEEPSEEK)
async def test_greedy_tokens_match_transformers_in_one_batch(tiny_model, family):
    path = tiny_model(family)
    engine = _engine(path)
    seqs = [await _admit(engine, f"r{i}", prompt, 10) for i, prompt in enumerate(PROMPTS)]
    got = await asyncio.gather(*(_drain(s) for s in seqs))
    for seq, tokens in zip(seqs, got):
        assert [seq.output_ids[0], *tokens] == _hf_greedy(path, seq.prompt_ids, 10)
    assert _all_back(engine)
    await engine.close()


async def test_an_fp8_block_scaled_checkpoint_decodes_as_transformers_runs_its_dequantized_twin(tiny_fp8_pair):
    fp8, twin = tiny_fp8_pair("deepseek_v3")
    engine = _engine(fp8)
    seqs = [await _admit(engine, f"r{i}", prompt, 10) for i, prompt in enumerate(PROMPTS)]
    got = await asyncio.gather(*(_drain(s) for s in seqs))
    for seq, tokens in zip(seqs, got):
        assert [seq.output_ids[0], *tokens] == _hf_greedy(twin, seq.prompt_ids, 10)
    assert _all_back(engine)
    await engine.close()


@pytest.mark.parametrize("family", DEEPSEEK)
def test_the_cache_holds_transformers_latent_and_rotated_key_only(tiny_model, family):
    """Per token and layer one entry of kv_lora_rank + qk_rope_head_dim values, no V: the kv_a_layernorm'd
    latent and the rotated key as transformers' own cache holds them (V3 de-interleaved, V2 interleaved)."""
    import transformers

    path = tiny_model(family)
    config = load_config(path)
    layout = KvLayout.for_model(config, 4, "float32")
    latent = config.mla.kv_lora_rank + config.mla.qk_rope_head_dim
    assert (config.mla.kv_lora_rank, config.mla.qk_rope_head_dim) == (32, 16)
    assert layout.kind == "mla_latent" and (layout.num_kv_heads, layout.head_dim) == (1, latent)
    assert layout.bytes_per_token == config.num_layers * latent * 4  # fp32: (32 + 16) x 4 bytes per layer
    assert PagedKvCache.bytes_per_block(layout) == 4 * layout.bytes_per_token
    int8 = KvLayout.for_model(config, 4, "int8")
    assert PagedKvCache.bytes_per_block(int8) == config.num_layers * (4 * latent + 4)  # one scale per block, layer

    cache = PagedKvCache(layout, 8)
    assert cache.v.numel() == 0 and cache.nbytes == 8 * PagedKvCache.bytes_per_block(layout)
    prompt = PROMPTS[0]
    model = build_model(config, load_weights(path))
    model.prefill(torch.tensor(prompt), [3, 1, 6, 0], cache)
    k, v = cache.read([3, 1, 6, 0], len(prompt))  # [L, T, 1, C + R], [L, T, 1, 0]
    assert v.shape == (config.num_layers, len(prompt), 1, 0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([prompt]), use_cache=True).past_key_values
    for layer in range(config.num_layers):
        latents, keys = theirs.layers[layer].keys[0, 0], theirs.layers[layer].values[0, 0]  # [T, C], [T, R]
        torch.testing.assert_close(k[layer, :, 0], torch.cat((latents, keys), -1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", DEEPSEEK)
async def test_a_quantized_latent_cache_serves(tiny_model, family):
    """int8 and fp8 latents (one scale per block per layer): the requests run to their lengths and every block
    comes back (their tokens may differ from fp32's)."""
    for kv_dtype in ("int8", "fp8_e4m3"):
        engine = _engine(tiny_model(family), kv_dtype=kv_dtype)
        assert engine.cache.v_scales.numel() == 0
        seq = await _admit(engine, "q", PROMPTS[2], 6)
        assert len([seq.output_ids[0], *await _drain(seq)]) == 6
        assert _all_back(engine)
        await engine.close()


def _router(family: str, fields: dict):
    """(transformers' router module of a 16-expert DeepSeek config with `fields`, that config.json)."""
    import transformers
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

    v3_family = family == "deepseek_v3"
    cls = transformers.DeepseekV3Config if v3_family else transformers.DeepseekV2Config
    config = cls(hidden_size=16, n_routed_experts=16, num_experts_per_tok=3, num_attention_heads=2,
                 num_key_value_heads=2, **fields)
    torch.manual_seed(3)
    gate = (v3.DeepseekV3TopkRouter if v3_family else v2.DeepseekV2TopkRouter)(config)
    with torch.no_grad():
        gate.weight.normal_(0.0, 1.0)
        if v3_family:
            gate.e_score_correction_bias.normal_(0.0, 0.5)
    arch = "DeepseekV3ForCausalLM" if v3_family else "DeepseekV2ForCausalLM"
    return gate, dict(config.to_dict(), architectures=[arch])


@pytest.mark.parametrize("family, fields", [
    ("deepseek_v3", dict(n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)),
    ("deepseek_v3", dict(n_group=4, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0)),
    ("deepseek_v2", dict(topk_method="greedy", routed_scaling_factor=1.5)),
    ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2)),
])
def test_routing_chooses_and_weighs_as_transformers(tmp_path, family, fields):
    from pdserve.server.model.config import parse_config

    gate, raw = _router(family, fields)
    moe = parse_config(raw, tmp_path).moe
    x = torch.randn(64, 16)
    with torch.no_grad():
        _, their_weights, their_experts = gate(x)
    logits = torch.nn.functional.linear(x, gate.weight)
    bias = gate.e_score_correction_bias if family == "deepseek_v3" else None
    weights, experts = route(logits, moe, bias)
    ours, theirs = experts.sort(-1), their_experts.sort(-1)
    assert torch.equal(ours.values, theirs.values)  # the same experts for every token
    torch.testing.assert_close(weights.gather(1, ours.indices), their_weights.gather(1, theirs.indices))
    if bias is not None:  # the bias changes choices here, and only choices: the weights stay the plain scores
        unbiased = route(logits, moe)[1].sort(-1).values
        assert not torch.equal(unbiased, ours.values)
        scale = moe.routed_scale / (logits.sigmoid().gather(1, experts).sum(-1, keepdim=True) if moe.renormalize else 1)
        torch.testing.assert_close(weights, logits.sigmoid().gather(1, experts) * scale)
