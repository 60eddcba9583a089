"""Mixture-of-experts prefill with its experts split over 2 and 4 forced host devices equals the unsharded
prefill: same greedy first tokens, logits and KV within fp32 rounding, each device holding its share of
the experts — over the tensor-parallel axis alone (tp 2, tp 4) and over an expert axis beside it (tp 2 x ep 2,
tp 1 x ep 4), where the attention's heads split over tp only. The served engine on a tp 2 x ep 2 mesh compiles
every shape before its first request. (Run in subprocesses: host devices exist only if XLA_FLAGS is set before
jax starts.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = r"""
import json, math, re, sys
import jax, jax.numpy as jnp, numpy as np
from pdserve.server.model.config import load_config
from pdserve.server.model.weights import load_weights
from pdserve.server.prefill.model import load_params, make_prefill_fn
from pdserve.server.prefill.sharding import make_mesh, shard_params

def error_of(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)

def gathered(hlo):  # the most elements any all-gather of the compiled program returns (0: none)
    shapes = re.findall(r"= \w+\[([\d,]*)\]\S* all-gather(?:-start)?\(", hlo)
    return max((math.prod(int(d) for d in dims.split(",") if d) for dims in shapes), default=0)

report = {}
for path, meshes in json.loads(sys.argv[1]):
    config = load_config(path)
    params = load_params(config, load_weights(path))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 512, (3, 32)), jnp.int32)
    lengths = jnp.array([5, 32, 19], jnp.int32)
    fn = make_prefill_fn(config)
    want = fn(params, tokens, lengths)
    for tp, ep in meshes:
        mesh = make_mesh(tp, ep)
        sharded = shard_params(params, mesh, config)
        got = fn(sharded, tokens, lengths)
        layers = sharded["layers"]
        report[f"{config.family}/{tp}x{ep}"] = {
            "mesh": dict(mesh.shape),
            "tokens": np.asarray(got[0]).argmax(-1).tolist(), "want": np.asarray(want[0]).argmax(-1).tolist(),
            "max_err": max(float(np.abs(np.asarray(g) - np.asarray(w)).max()) for g, w in zip(got, want)),
            "experts_per_device": sorted({s.data.shape[1] for s in layers["e_gate"].addressable_shards}),
            "q_heads_per_device": sorted({s.data.shape[2] for s in layers["wq"].addressable_shards}),
            "devices": len(layers["e_gate"].sharding.device_set),
            "expert_weights": math.prod(layers["e_gate"].shape[2:]),  # one expert's gate: H x I
            "gathered": gathered(jax.jit(fn).lower(sharded, tokens, lengths).compile().as_text()) if ep > 1 else 0,
        }
    report[f"{config.family}/refusals"] = {
        "kv_heads": error_of(lambda: shard_params(params, make_mesh(4, 1), config)),
        "experts": error_of(lambda: shard_params(params, make_mesh(1, 3), config)),
    }
dense = load_config(sys.argv[2])
report["dense"] = error_of(lambda: shard_params(load_params(dense, load_weights(sys.argv[2])), make_mesh(2, 2), dense))
report["too_many"] = error_of(lambda: make_mesh(2, 4))
print(json.dumps(report))
"""


def test_experts_split_over_tp_and_an_expert_axis_give_the_same_tokens(tiny_model):
    # mixtral: 4 kv heads, 8 experts; qwen3_moe: 2 kv heads, so tp stops at 2 and an expert axis takes the rest
    cases = [(str(tiny_model("mixtral")), [(2, 1), (4, 1), (2, 2), (1, 4)]),
             (str(tiny_model("qwen3_moe")), [(2, 1), (2, 2)])]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(cases), str(tiny_model("qwen2"))], env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    runs = {"mixtral/2x1", "mixtral/4x1", "mixtral/2x2", "mixtral/1x4", "qwen3_moe/2x1", "qwen3_moe/2x2"}
    assert runs <= set(report)
    heads = {"mixtral": 4, "qwen3_moe": 4}  # query heads
    for name in runs:
        r = report[name]
        family, (tp, ep) = name.split("/")[0], map(int, name.split("/")[1].split("x"))
        assert r["mesh"] == {"ep": ep, "tp": tp}, name
        assert r["tokens"] == r["want"], name
        assert r["max_err"] < 1e-4, name
        assert r["experts_per_device"] == [8 // (tp * ep)] and r["devices"] == tp * ep, name
        assert r["q_heads_per_device"] == [heads[family] // tp], name  # attention over tp only
        # XLA splits the grouped matmul by expert: each device multiplies its own experts' rows and an all-reduce
        # sums the outputs; no expert's weights are gathered (the only all-gathers: the [E] group sizes). Checked
        # on the meshes with an expert axis (tp alone compiles the same split).
        assert r["gathered"] < r["expert_weights"], name
    assert "num_kv_heads (2)" in report["qwen3_moe/refusals"]["kv_heads"]
    assert "num_experts (8)" in report["mixtral/refusals"]["experts"]
    assert "expert parallelism 3" in report["mixtral/refusals"]["experts"]
    assert "--expert-parallel-size 2 splits a mixture of experts; qwen2 has none" in report["dense"]
    assert report["too_many"] == "a mesh of 8 devices (2 x 4: tensor x expert parallel) was asked for; 4 are present"


SERVED = r"""
import asyncio, json, sys
from pathlib import Path
import jax, jax.monitoring, jax.numpy as jnp, numpy as np
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.server.model.config import load_config
from pdserve.server.model.weights import load_weights
from pdserve.server.prefill.config import PrefillConfig
from pdserve.server.prefill.main import load_engine
from pdserve.server.prefill.model import load_params, make_prefill_fn

events = []
jax.monitoring.register_event_duration_secs_listener(lambda e, d, **kw: events.append(e) if "compile" in e else None)
path = Path(sys.argv[1])
greedy = gen_pb.SamplingParams(max_tokens=2, temperature=0.0)
prompts = [list(range(3, 3 + n)) for n in (5, 40, 17)]
engine = load_engine(PrefillConfig(model_dir=path, tensor_parallel_size=2, expert_parallel_size=2, max_batch_size=2,
                                   max_model_len=64), progress=False)
experts = engine.runner.group_layers[0]["e_gate"]
before = len(events)

async def run():
    return await asyncio.gather(*(engine.submit(p, greedy, 0, "float32") for p in prompts))

results = asyncio.run(run())
compiles = len(events) - before
config = load_config(path)
params = load_params(config, load_weights(path))
fn = make_prefill_fn(config)
want = []
for p in prompts:
    logits = fn(params, jnp.asarray([p], jnp.int32), jnp.asarray([len(p)], jnp.int32))[0]
    want.append(int(np.asarray(logits).reshape(-1, logits.shape[-1])[-1].argmax()))
print(json.dumps({"mesh": dict(experts.sharding.mesh.shape), "compiles": compiles,
                  "first": [r.first_token for r in results], "want": want,
                  "experts_per_device": sorted({s.data.shape[1] for s in experts.addressable_shards})}))
"""


def test_the_served_engine_on_tp2_x_ep2_compiles_before_serving_and_gives_one_devices_tokens(tiny_model):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", SERVED, str(tiny_model("qwen3_moe"))], env=env, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["mesh"] == {"ep": 2, "tp": 2} and r["experts_per_device"] == [2]
    assert r["compiles"] == 0
    assert r["first"] == r["want"]
