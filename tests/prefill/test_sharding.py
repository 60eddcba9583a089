"""Tensor-parallel prefill over a 2-device CPU mesh equals the unsharded prefill.

Multiple CPU devices exist only if XLA_FLAGS is set before jax starts, so the check runs in a
subprocess (with 4 host devices) and reports back as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

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
