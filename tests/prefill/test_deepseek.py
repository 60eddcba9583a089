"""DeepSeek-V2/V3 on the JAX prefill tier: the first token and the latent KV (one entry of kv_lora_rank +
qk_rope_head_dim values per token and layer, no V) against transformers, through the engine's packing, chunking,
prefix cache and wire formats; DeepSeek's routing against the decode tier's."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from pdserve.kvcache import quant as host_quant
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.server.model.config import load_config
from pdserve.server.model.weights import load_weights
from pdserve.server.prefill.config import PrefillConfig
from pdserve.server.prefill.engine import PrefillEngine
from pdserve.server.prefill.model import load_params

DEEPSEEK = ["deepseek_v3", "deepseek_v2"]
GREEDY = gen_pb.SamplingParams(max_tokens=4, temperature=0.0, top_p=1.0, top_k=0)
PROMPTS = [[5, 17, 99, 3, 250, 11, 42, 7, 8, 300, 301, 2, 9], [40, 41, 42], list(range(100, 141))]


def _engine(path, **kw) -> PrefillEngine:
    config = load_config(path)
    return PrefillEngine(config, load_params(config, load_weights(path)), PrefillConfig(model_dir=path, **kw))


_HF: dict = {}


def _transformers(path, prompt: list[int]) -> tuple[int, np.ndarray]:
    """(transformers' greedy first token, its cache's [latent | rotated key] [L, T, C + R]) for the prompt, fp32."""
    import torch
    import transformers

    if path not in _HF:
        _HF[path] = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = _HF[path](torch.tensor([prompt]), use_cache=True)
    cache = out.past_key_values
    entries = np.stack([torch.cat((layer.keys[0, 0], layer.values[0, 0]), -1).numpy() for layer in cache.layers])
    return int(out.logits[0, -1].argmax()), entries


@pytest.mark.parametrize("family", DEEPSEEK)
@pytest.mark.parametrize("groups", [4, 1])  # one layer a group (dense, then MoE), or all three in one
async def test_first_token_and_latent_kv_are_transformers(tiny_model, family, groups):
    path = tiny_model(family)
    config = load_config(path)
    engine = _engine(path, kv_layer_groups=groups)
    results = await asyncio.gather(*(engine.submit(p, GREEDY, 0, "float32") for p in PROMPTS))
    for prompt, got in zip(PROMPTS, results):
        first, entries = _transformers(path, prompt)
        assert got.first_token == first
        assert got.k.shape == (config.num_layers, len(prompt), 1, 32 + 16)  # kv_lora_rank + qk_rope_head_dim
        assert got.v.shape == (config.num_layers, len(prompt), 1, 0)  # no V
        np.testing.assert_allclose(got.k[:, :, 0], entries, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("family", DEEPSEEK)
async def test_chunks_and_cached_prefixes_attend_to_the_latent_context(tiny_model, family):
    """A prompt in 16-token chunks, then again from the prefix cache (its blocks' latents as the context):
    transformers' first token and entries both times."""
    path = tiny_model(family)
    engine = _engine(path, max_prefill_chunk=16, max_batch_tokens=16)
    prompt = PROMPTS[2]  # 41 tokens: chunks of 16, 16, 9
    first, entries = _transformers(path, prompt)
    for _ in range(2):
        got = await engine.submit(prompt, GREEDY, 0, "float32")
        assert got.first_token == first
        np.testing.assert_allclose(got.k[:, :, 0], entries, atol=2e-5, rtol=1e-5)
    assert engine.prefix.hits == 32  # the second time, two 16-token blocks came from the cache
    assert engine.prefix.v.shape[-1] == 0 and engine.prefix.layout.kind == "mla_latent"


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
async def test_quantized_latents_carry_one_scale_per_block_and_layer(tiny_model, kv_dtype):
    path = tiny_model("deepseek_v3")
    engine = _engine(path)
    prompt = PROMPTS[2]
    got = await engine.submit(prompt, GREEDY, 0, kv_dtype, block_size=16)
    _, entries = _transformers(path, prompt)
    assert str(got.k.dtype) == ("int8" if kv_dtype == "int8" else "float8_e4m3fn")
    assert got.k_scales.shape == (3, 3, 1) and got.v_scales.shape == (3, 3, 0) and got.v.shape == (3, 41, 1, 0)
    want, want_scales = host_quant.quantize(entries[:, :, None], 16, kv_dtype)
    np.testing.assert_allclose(got.k_scales, want_scales, rtol=1e-5)
    back = host_quant.dequantize(got.k, got.k_scales, 16)[:, :, 0]
    bound = host_quant.error_bound(entries[:, :, None], want_scales, 16, kv_dtype)[:, :, 0]
    assert np.all(np.abs(back - entries) <= bound + 1e-5)


@pytest.mark.parametrize("family", DEEPSEEK)
def test_routing_is_the_decode_tiers(tiny_model, family):
    """The prefill tier's `moe.route` picks the decode tier's experts with its weights: V3's sigmoid scores, best 2
    of 4 groups by the sum of their top two, the correction bias for the choice only, renormalised x 2.5; V2's
    softmax top-k, never renormalised. Also with a bias large enough to move the choice."""
    import jax.numpy as jnp
    import torch

    from pdserve.server.decode.moe import route as torch_route
    from pdserve.server.prefill.moe import route as jax_route

    moe = load_config(tiny_model(family)).moe
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, moe.num_experts)).astype(np.float32)
    bias = (rng.normal(size=moe.num_experts) * 0.5).astype(np.float32) if moe.correction_bias else None
    for m in (moe, dataclasses.replace(moe, num_groups=1, topk_groups=1)):
        w, e = jax_route(jnp.asarray(logits), m, None if bias is None else jnp.asarray(bias))
        tw, te = torch_route(torch.from_numpy(logits), m, None if bias is None else torch.from_numpy(bias))
        order, torder = np.argsort(np.asarray(e), -1), np.argsort(te.numpy(), -1)
        np.testing.assert_array_equal(np.take_along_axis(np.asarray(e), order, -1),
                                      np.take_along_axis(te.numpy(), torder, -1))
        np.testing.assert_allclose(np.take_along_axis(np.asarray(w), order, -1),
                                   np.take_along_axis(tw.numpy(), torder, -1), rtol=1e-6)
    if bias is not None:  # the bias changes the choice and not the weights' source
        biased, unbiased = (np.sort(np.asarray(jax_route(jnp.asarray(logits), moe, b)[1]), -1)
                            for b in (jnp.asarray(bias), None))
        assert not np.array_equal(biased, unbiased)


class _CacheSink:
    """The decode tier's receive path: each received piece written into a latent `PagedKvCache`, scales too."""

    def __init__(self, cache, table: list[int]) -> None:
        self.cache, self.table = cache, table

    def write(self, request_id, piece) -> None:
        self.cache.write(self.table, piece.layer_start, piece.token_start, piece.k, piece.v, piece.k_scales,
                         piece.v_scales)


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "int8", "fp8_e4m3"])
async def test_the_wire_carries_the_latent_alone_into_the_decode_cache(tiny_model, kv_dtype):
    """A real PrefillService pushes to a real KvReceiver writing the decode tier's latent cache: the bytes received
    per token per layer are (kv_lora_rank + qk_rope_head_dim) x the dtype's size, plus one float32 scale per block
    per layer for int8/fp8 (no V, no V scales); the cache then holds transformers' entries (within the format's
    rounding)."""
    import torch

    from pdserve.kvcache.layout import KvLayout
    from pdserve.kvcache.local import LocalKvTransport
    from pdserve.kvcache.receiver import KvReceiver
    from pdserve.server.decode.kv_cache import PagedKvCache
    from pdserve.server.model.fingerprint import fingerprint
    from pdserve.server.prefill.service import PrefillService
    from pdserve.v1 import worker_pb2 as pb

    from .test_push import TOKEN, Context

    path = tiny_model("deepseek_v3")
    config = load_config(path)
    engine = _engine(path, kv_layer_groups=2, prefix_cache_bytes=0)
    layout = KvLayout.for_model(config, 16, kv_dtype)
    prompt = PROMPTS[2]  # 41 tokens: 3 blocks of 16
    table = [2, 0, 1]
    cache = PagedKvCache(layout, 4)
    digest = fingerprint(path, config)
    receiver = KvReceiver(layout, digest, _CacheSink(cache, table))
    service = PrefillService(engine, LocalKvTransport({"d": receiver}, num_streams=2), config, fingerprint=digest)
    transfer = receiver.expect("r", 0, TOKEN, len(prompt))
    reply = await service.Prefill(pb.PrefillRequest(
        request_id="r", attempt=0, token_ids=prompt, sampling=GREEDY, transfer_token=TOKEN,
        target=pb.KvTarget(address="d", layout=layout.to_proto())), Context())
    first, entries = _transformers(path, prompt)
    assert reply.first_token_id == first
    assert await asyncio.wait_for(transfer.done, 30) == first
    size = {"float32": 4, "bfloat16": 2, "int8": 1, "fp8_e4m3": 1}[kv_dtype]
    scales = 3 * 4 if kv_dtype in ("int8", "fp8_e4m3") else 0  # 3 blocks x one float32, per layer
    assert transfer.bytes_received == config.num_layers * (len(prompt) * (32 + 16) * size + scales)
    k, v = cache.read(table, len(prompt))  # [L, T, 1, C + R] as stored (int8/fp8: beside its scales)
    assert v.shape == (config.num_layers, len(prompt), 1, 0)
    if kv_dtype in ("int8", "fp8_e4m3"):
        k_scales, v_scales = cache.read_scales(table, len(prompt))
        assert tuple(v_scales.shape) == (config.num_layers, 3, 0)
        got = host_quant.dequantize(k.float().numpy(), k_scales.numpy(), 16)[:, :, 0]
        _, want_scales = host_quant.quantize(entries[:, :, None], 16, kv_dtype)
        bound = host_quant.error_bound(entries[:, :, None], want_scales, 16, kv_dtype)[:, :, 0]
        assert np.all(np.abs(got - entries) <= bound + 1e-5)
    else:
        tol = 1e-5 if kv_dtype == "float32" else 1e-2
        np.testing.assert_allclose(k[:, :, 0].to(torch.float32).numpy(), entries, atol=tol, rtol=tol)


async def test_a_decode_target_holding_heads_of_the_latents_shape_is_refused(tiny_model):
    """The handshake's layout kind: a target whose layout has the latent's shape but kind heads (a decode worker
    that would read the entries as K and V) is refused before anything is computed, naming both kinds."""
    import grpc

    from pdserve.kvcache.layout import KvLayout
    from pdserve.kvcache.local import LocalKvTransport
    from pdserve.server.prefill.service import PrefillService
    from pdserve.v1 import worker_pb2 as pb

    from .test_push import TOKEN, Aborted, Context

    path = tiny_model("deepseek_v3")
    config = load_config(path)
    engine = _engine(path)
    service = PrefillService(engine, LocalKvTransport({}), config, fingerprint="f")
    heads = KvLayout.of(config.num_layers, 1, 32 + 16, 16, "float32")
    with pytest.raises(Aborted) as refused:
        await service.Prefill(pb.PrefillRequest(
            request_id="r", attempt=0, token_ids=[1, 2, 3], sampling=GREEDY, transfer_token=TOKEN,
            target=pb.KvTarget(address="d", layout=heads.to_proto())), Context())
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "KV layout is of kind heads, this prefill worker's model computes mla_latent" in refused.value.details
    assert engine.batches == 0


def test_what_the_prefill_tier_does_not_do_for_latent_attention_is_refused_at_start(tiny_model):
    from pdserve.server.model.config import ModelLoadError
    from pdserve.server.prefill.main import _check_latent_attention

    path = tiny_model("deepseek_v2")
    config = load_config(path)
    _check_latent_attention(config, PrefillConfig(model_dir=path), processes=1)  # one process's mesh serves
    with pytest.raises(ModelLoadError, match="a slice of 2 processes is not built .* drop --coordinator-address"):
        _check_latent_attention(config, PrefillConfig(model_dir=path), processes=2)
    with pytest.raises(ModelLoadError, match="--weight-dtype int8: .* use --weight-dtype auto"):
        _check_latent_attention(config, PrefillConfig(model_dir=path, weight_dtype="int8"), processes=1)
    with pytest.raises(ModelLoadError, match="--prefill-matmul onednn-bf16: .* pass --prefill-matmul auto"):
        _check_latent_attention(config, PrefillConfig(model_dir=path, prefill_matmul="onednn-bf16"), processes=1)


async def test_latent_blocks_spill_to_an_offload_tier_and_come_back_as_entries():
    """The prefill tier's prefix KV of a latent model: a block evicted past the budget is saved to the host tier as
    the latent entries alone (one block of 3 layers x 16 tokens x 48 fp32 values), and comes back as them, V empty."""
    from pdserve.kvcache.block_bytes import block_nbytes
    from pdserve.kvcache.host_store import HostStore
    from pdserve.kvcache.tiered_store import TieredStore
    from pdserve.server.prefill.prefix_kv import PrefixKv

    block = 3 * 16 * 48 * 4
    offload = TieredStore([HostStore(1 << 20)])
    prefix = PrefixKv(num_layers=3, num_kv_heads=1, head_dim=48, dtype=np.float32, budget_bytes=2 * block,
                      offload=offload, kind="mla_latent")
    assert block_nbytes(prefix.layout) == block and prefix.v.shape == (2, 3, 16, 1, 0)
    rng = np.random.default_rng(0)
    first, second = list(range(1, 34)), list(range(100, 133))  # 2 full blocks each
    k1, k2 = (rng.standard_normal((3, 33, 1, 48), dtype=np.float32) for _ in range(2))
    empty = np.zeros((3, 33, 1, 0), np.float32)
    prefix.store(first, k1, empty)
    prefix.store(second, k2, empty)  # evicts the first prompt's blocks: spilled to the host tier
    assert offload.wait_saved(10)
    assert prefix.lookup(first, 16) is None
    fetched = await prefix.fetch(first)
    assert fetched is not None and fetched.start == 0 and len(fetched.blocks) == 2
    k, v = prefix.lookup(first, 16, fetched=fetched)
    assert k.tobytes() == k1[:, :32].tobytes() and v.shape == (3, 32, 1, 0)
    offload.close()
