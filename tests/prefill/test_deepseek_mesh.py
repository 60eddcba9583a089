"""DeepSeek-V2/V3 prefill on a mesh of 4 forced host devices equals the one-device prefill (itself checked against
transformers in test_deepseek.py): the same greedy first tokens, logits and latent KV within fp32 rounding with
tp 1 x ep 2, tp 1 x ep 4, tp 2 x ep 2 and tp 4 x ep 1, each device holding its share of the query heads (over tp)
and of the routed experts (over ep x tp), the latent entry computed whole on every device. The served engine on
tp 2 x ep 2 gives the same first tokens and entries. (Run in a subprocess: host devices exist only if XLA_FLAGS
is set before jax starts.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

MESHES = [(1, 2), (1, 4), (2, 2), (4, 1)]  # (tp, ep)

SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from pdserve.server.model.config import load_config
from pdserve.server.model.weights import load_weights
from pdserve.server.prefill.config import PrefillConfig
from pdserve.server.prefill.deepseek import _count
from pdserve.server.prefill.main import load_engine
from pdserve.server.prefill.model import load_params, make_prefill_fn
from pdserve.server.prefill.sharding import default_size, make_mesh, shard_params
from pdserve.v1 import generation_pb2 as gen_pb

def error_of(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)

def per_device(w, axis):
    return sorted({s.data.shape[axis] for s in w.addressable_shards})

paths, meshes, served = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
report = {}
lengths = [5, 32, 19]
for path in paths:
    config = load_config(path)
    params = load_params(config, load_weights(path))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, min(512, config.vocab_size), (3, 32)), jnp.int32)
    fn = make_prefill_fn(config)
    want_logits, want_k, _ = fn(params, tokens, jnp.asarray(lengths, jnp.int32))
    for tp, ep in meshes:
        sharded = shard_params(params, make_mesh(tp, ep), config)
        logits, k, v = fn(sharded, tokens, jnp.asarray(lengths, jnp.int32))
        dense, moe = sharded["layers"]["dense"], sharded["layers"]["moe"]
        report[f"{config.family}/{tp}x{ep}"] = {
            "tokens": np.asarray(logits).argmax(-1).tolist(), "want": np.asarray(want_logits).argmax(-1).tolist(),
            "logits_err": float(np.abs(np.asarray(logits) - np.asarray(want_logits)).max()),
            "kv_err": max(float(np.abs(np.asarray(k)[:, b, :n] - np.asarray(want_k)[:, b, :n]).max())
                          for b, n in enumerate(lengths)),
            "kv_shape": list(k.shape), "v_shape": list(v.shape),
            "kv_whole_on_each_device": bool(k.sharding.is_fully_replicated),
            "experts_per_device": per_device(moe["e_gate"], 1),
            "devices": len(moe["e_gate"].sharding.device_set),
            "heads_per_device": per_device(moe["w_uk"], 2) + per_device(dense["wo"], 1),
            "shared_per_device": per_device(moe["s_gate"], 2),
            "dense_per_device": per_device(dense["w_gate"], 2),
            "latent_per_device": per_device(moe["wkv_a"], 2),
        }
    report[f"{config.family}/refusals"] = {
        "heads": error_of(lambda: shard_params(params, make_mesh(3, 1), config)),
        "experts": error_of(lambda: shard_params(params, make_mesh(1, 3), config)),
    }
    report[f"{config.family}/default"] = [default_size(config, 4, 1), default_size(config, 4, 1, expert_parallel=2)]

greedy = gen_pb.SamplingParams(max_tokens=2, temperature=0.0)
prompts = [list(range(3, 3 + n)) for n in (5, 30, 17)]
engine = load_engine(PrefillConfig(model_dir=served, tensor_parallel_size=2, expert_parallel_size=2, max_batch_size=2,
                                   max_model_len=32), progress=False)
import asyncio

async def run():
    return await asyncio.gather(*(engine.submit(p, greedy, 0, "float32") for p in prompts))

results = asyncio.run(run())
config = load_config(served)
params = load_params(config, load_weights(served))
fn = make_prefill_fn(config)
first, kv_err = [], 0.0
for p, r in zip(prompts, results):
    logits, k, _ = fn(params, jnp.asarray([p], jnp.int32), jnp.asarray([len(p)], jnp.int32))
    first.append(int(np.asarray(logits)[0].argmax()))
    kv_err = max(kv_err, float(np.abs(np.asarray(r.k) - np.asarray(k)[:, 0]).max()))
experts = next(g["moe"]["e_gate"] for g in engine.runner.group_layers if _count(g["moe"]))
report["served"] = {"mesh": dict(experts.sharding.mesh.shape), "first": [r.first_token for r in results],
                    "want": first, "kv_err": kv_err, "experts_per_device": per_device(experts, 1)}
print(json.dumps(report))
"""


def test_deepseek_on_a_mesh_gives_the_one_device_tokens_and_latent_kv(tiny_model):
    paths = [str(tiny_model("deepseek_v3")), str(tiny_model("deepseek_v2"))]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(paths), json.dumps(MESHES), paths[0]], env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    # the tiny DeepSeeks: 3 layers (1 dense), 4 heads, kv_lora_rank 32 + rope 16, 8 experts of 32, dense MLP 256;
    # shared experts: V3 one (32), V2 two (64)
    shared = {"deepseek_v3": 32, "deepseek_v2": 64}
    for family in shared:
        for tp, ep in MESHES:
            r = report[f"{family}/{tp}x{ep}"]
            name = f"{family} tp {tp} x ep {ep}"
            assert r["tokens"] == r["want"], name
            assert r["logits_err"] < 1e-4 and r["kv_err"] < 1e-5, name
            assert r["kv_shape"] == [3, 3, 32, 1, 48] and r["v_shape"] == [3, 3, 32, 1, 0], name
            assert r["kv_whole_on_each_device"], name
            assert r["devices"] == tp * ep and r["experts_per_device"] == [8 // (tp * ep)], name
            assert r["heads_per_device"] == [4 // tp, 4 // tp], name  # heads over tp only
            assert r["shared_per_device"] == [shared[family] // tp], name
            assert r["dense_per_device"] == [256 // tp], name
            assert r["latent_per_device"] == [48], name  # the latent projection is whole on every device
        refusals = report[f"{family}/refusals"]
        assert "tensor parallelism 3 must divide the model's num_attention_heads (4)" in refusals["heads"]
        assert "each device holds whole heads" in refusals["heads"]
        assert "num_experts (8)" in refusals["experts"] and "expert parallelism 3" in refusals["experts"]
        assert report[f"{family}/default"] == [4, 2]
    served = report["served"]
    assert served["mesh"] == {"ep": 2, "tp": 2} and served["experts_per_device"] == [2]
    assert served["first"] == served["want"]
    assert served["kv_err"] < 1e-5
