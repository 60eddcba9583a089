"""Mixture-of-experts prefill with its experts split over 2 and 4 forced host devices equals the unsharded
prefill: same greedy first tokens, logits and KV within fp32 rounding, each device holding its share of
the experts. (Run in a subprocess: host devices exist only if XLA_FLAGS is set before jax starts.)"""

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

report = {}
for path, sizes in json.loads(sys.argv[1]):
    config = load_config(path)
    params = load_params(config, load_weights(path))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 512, (3, 32)), jnp.int32)
    lengths = jnp.array([5, 32, 19], jnp.int32)
    fn = make_prefill_fn(config)
    want = fn(params, tokens, lengths)
    for n in sizes:
        sharded = shard_params(params, make_mesh(n), config)
        got = fn(sharded, tokens, lengths)
        experts = sharded["layers"]["e_gate"]
        report[f"{config.family}/{n}"] = {
            "tokens": np.asarray(got[0]).argmax(-1).tolist(), "want": np.asarray(want[0]).argmax(-1).tolist(),
            "max_err": max(float(np.abs(np.asarray(g) - np.asarray(w)).max()) for g, w in zip(got, want)),
            "experts_per_device": sorted({s.data.shape[1] for s in experts.addressable_shards}),
        }
print(json.dumps(report))
"""


def test_experts_split_over_2_and_4_devices_give_the_same_tokens(tiny_model):
    cases = [(str(tiny_model("mixtral")), [2, 4]), (str(tiny_model("qwen3_moe")), [2])]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(cases)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(report) == {"mixtral/2", "mixtral/4", "qwen3_moe/2"}
    for name, r in report.items():
        n = int(name.split("/")[1])
        assert r["tokens"] == r["want"], name
        assert r["max_err"] < 1e-4, name
        assert r["experts_per_device"] == [8 // n], name
