"""The real tiers in one process without sockets: the JAX PrefillService pushes through the in-memory
transport (kvcache.local) to a KvReceiver whose sink is the torch DecodeEngine, the same path the KV takes
over gRPC, and decoding from it gives transformers' greedy tokens, a prefix-cache hit included."""

from __future__ import annotations

import asyncio

from pdserve.kvcache.layout import KvLayout
from pdserve.kvcache.local import LocalKvTransport
from pdserve.kvcache.receiver import KvReceiver
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb
from pdserve.server.decode.engine import DecodeEngine
from pdserve.server.decode.weights import build_model
from pdserve.server.model.config import load_config
from pdserve.server.model.fingerprint import fingerprint
from pdserve.server.model.weights import load_weights
from pdserve.server.prefill.config import PrefillConfig
from pdserve.server.prefill.engine import PrefillEngine
from pdserve.server.prefill.model import load_params
from pdserve.server.prefill.service import PrefillService

from ..decode.test_engine import _drain, _hf_greedy

DECODE = "decode-0"
TOKEN = b"k" * 16
GREEDY = gen_pb.SamplingParams(max_tokens=6, temperature=0.0, top_p=1.0, ignore_eos=True)


class Context:
    async def abort(self, code, details=""):
        raise AssertionError(f"{code.name}: {details}")


async def test_prefill_to_decode_through_the_in_memory_transport_matches_transformers(tiny_model):
    path = tiny_model("llama")
    config = load_config(path)
    weights = load_weights(path)
    digest = fingerprint(path, config)
    layout = KvLayout(config.num_layers, config.num_kv_heads, config.head_dim, 4, "float32")
    decode = DecodeEngine(build_model(config, weights), layout, num_blocks=32, max_running=4)
    receiver = KvReceiver(layout, digest, decode)  # the decode worker's sink: pieces land in its paged cache
    prefill = PrefillService(
        PrefillEngine(config, load_params(config, weights), PrefillConfig(model_dir=path, kv_layer_groups=2)),
        LocalKvTransport({DECODE: receiver}, num_streams=2, max_chunk_bytes=2 * 2048 + 64), config,
        fingerprint=digest)

    async def generate(rid: str, prompt: list[int]) -> tuple[list[int], int]:
        seq = decode.add(pb.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=GREEDY))
        await seq.admitted
        transfer = receiver.expect(rid, 0, TOKEN, len(prompt), cached_blocks=seq.num_hit_blocks)
        target = pb.KvTarget(address=DECODE, layout=layout.to_proto(), cached_blocks=seq.num_hit_blocks)
        reply = await prefill.Prefill(pb.PrefillRequest(request_id=rid, token_ids=prompt, sampling=GREEDY,
                                                        transfer_token=TOKEN, target=target), Context())
        assert await asyncio.wait_for(transfer.wait(30), 60) == reply.first_token_id
        decode.start(seq, reply.first_token_id)
        return [reply.first_token_id, *await _drain(seq)], transfer.bytes_received

    first = list(range(5, 26))  # 21 tokens: 5 full blocks and one partial
    tokens, sent = await generate("a", first)
    assert tokens == _hf_greedy(path, first, 6)
    assert sent == layout.bytes_per_token * len(first)
    second = first[:16] + [70, 71, 72]  # its first 4 blocks are cached now: the push skips them
    tokens, sent = await generate("b", second)
    assert tokens == _hf_greedy(path, second, 6)
    assert sent == layout.bytes_per_token * (len(second) - 16)
    await asyncio.gather(*prefill.pushes)
    await decode.close()
