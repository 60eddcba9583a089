"""Tensor-parallel prefill over a 2-device CPU mesh equals the unsharded prefill.

Multiple CPU devices exist only if XLA_FLAGS is set before jax starts, so the check runs in a
subprocess (with 4 host devices) and reports back as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from pdserve.server.model.config import load_config
from pdserve.server.prefill.sharding import default_size

SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np
from pdserve.server.model.config import load_config
from pdserve.server.model.weights import load_weights
from pdserve.server.prefill.model import load_params, make_prefill_fn
from pdserve.server.prefill.sharding import make_mesh, shard_params

def spec(array):
    return [list(a) if isinstance(a, tuple) else a for a in array.sharding.spec]

def error_of(call):
    try:
        call()
    except ValueError as e:
        return str(e)
    return None

report = {"devices": jax.device_count()}
for path in sys.argv[1:]:
    config = load_config(path)
    params = load_params(config, load_weights(path))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 512, (2, 16)), jnp.int32)
    lengths = jnp.array([5, 13], jnp.int32)
    fn = make_prefill_fn(config)
    want = fn(params, tokens, lengths)
    sharded = shard_params(params, make_mesh(2), config)
    got = fn(sharded, tokens, lengths)
    layers = sharded["layers"]
    report[config.family] = {
        "max_err": max(float(np.abs(np.asarray(g) - np.asarray(w)).max()) for g, w in zip(got, want)),
        "specs": {name: spec(a) for name, a in {**layers, "embed": sharded["embed"]}.items()},
        "lm_head": spec(sharded["lm_head"]) if "lm_head" in sharded else None,
        "wq_shard": list(layers["wq"].addressable_shards[0].data.shape),
        "wq_devices": len(layers["wq"].sharding.device_set),
        "tp4_error": error_of(lambda: shard_params(params, make_mesh(4), config)),
    }
report["mesh8_error"] = error_of(lambda: make_mesh(8))
print(json.dumps(report))
"""


def test_sharded_prefill_equals_unsharded(tiny_model):
    paths = [str(tiny_model("qwen2")), str(tiny_model("qwen3"))]  # biases + tied; q/k norm + lm_head
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, *paths], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["devices"] == 4
    assert report["mesh8_error"] == "a mesh of 8 devices was asked for; 4 are present"
    heads, inner, out = [None, None, "tp", None], [None, None, "tp"], [None, "tp", None]
    for family in ("qwen2", "qwen3"):
        r = report[family]
        assert r["max_err"] < 1e-5
        specs = r["specs"]
        assert specs["wq"] == specs["wk"] == specs["wv"] == heads
        assert specs["wo"] == [None, "tp", None, None]
        assert specs["w_gate"] == specs["w_up"] == inner and specs["w_down"] == out
        assert specs["embed"] == specs["attn_norm"] == specs["mlp_norm"] == []
        assert r["wq_devices"] == 2 and r["wq_shard"] == [2, 128, 2, 32]  # [L, H, Hq/tp, D]
        assert "num_kv_heads (2)" in r["tp4_error"]
    assert report["qwen2"]["specs"]["bq"] == [None, "tp", None]
    assert report["qwen2"]["lm_head"] is None  # tied: the replicated embedding serves as the head
    assert report["qwen3"]["specs"]["q_norm"] == []
    assert report["qwen3"]["lm_head"] == ["tp", None]  # vocab-split


SERVED = r"""
import asyncio, json, sys
from pathlib import Path
import jax, jax.monitoring, numpy as np
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.server.prefill.config import PrefillConfig
from pdserve.server.prefill.main import load_engine

events = []
jax.monitoring.register_event_duration_secs_listener(lambda e, d, **kw: events.append(e) if "compile" in e else None)
path = Path(sys.argv[1])
greedy = gen_pb.SamplingParams(max_tokens=2, temperature=0.0)
prompts = [list(range(3, 3 + n)) for n in (5, 40, 17)]

async def run(engine):  # one event loop per engine: its loop task lives on it
    return [r for kv_dtype in ("float32", "bfloat16")
            for r in await asyncio.gather(*(engine.submit(p, greedy, 0, kv_dtype) for p in prompts))]

report = {}
for name, tp in (("default", None), ("one", 1)):
    engine = load_engine(PrefillConfig(model_dir=path, tensor_parallel_size=tp, max_batch_size=2, max_model_len=64),
                         progress=False)
    wq = engine.runner.group_layers[0]["wq"]
    before = len(events)
    results = asyncio.run(run(engine))
    report[name] = {"devices": len(wq.sharding.device_set), "compiles": len(events) - before,
                    "first": [r.first_token for r in results], "shapes": [list(r.k.shape) for r in results],
                    "k": [r.k.astype(np.float32).tolist() for r in results]}
print(json.dumps(report))
"""


def test_served_engine_shards_over_all_devices_by_default(tiny_model):
    """`pdserve prefill` (load_engine) with 2 host devices: sharded over both, nothing compiles after
    start, and the first tokens and KV (gathered from the sharded arrays) equal one device's."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", SERVED, str(tiny_model("qwen2"))], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    sharded, one = report["default"], report["one"]
    assert (sharded["devices"], one["devices"]) == (2, 1)
    assert sharded["compiles"] == one["compiles"] == 0
    assert sharded["first"] == one["first"]
    assert sharded["shapes"] == one["shapes"] == [[2, n, 2, 32] for n in (5, 40, 17)] * 2
    for got, want in zip(sharded["k"], one["k"]):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-2, rtol=2e-2)


def test_a_slice_of_several_processes_shards_over_a_multiple_of_their_number(tiny_model):
    """Each process of a slice holds the same share of the mesh: the default size is the largest
    multiple of the process count that splits the model's 2 kv heads, and none may be refused."""
    config = load_config(tiny_model("qwen2"))
    assert (config.num_kv_heads, config.intermediate_size % 2) == (2, 0)
    assert default_size(config, num_devices=8, num_processes=1) == 2
    assert default_size(config, num_devices=4, num_processes=2) == 2
    assert default_size(config, num_devices=2, num_processes=2) == 2
    with pytest.raises(ValueError, match=r"kv heads \(2\) over all its 3 processes"):
        default_size(config, num_devices=6, num_processes=3)
