"""Host calls through the named FFI target (host_call.py): ops run on XLA's buffers in place, errors reach the
caller, the compiled programs are served from JAX's persistent cache in the next process, and without a C++
compiler the same ops run as Python callbacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdserve.server.prefill import host_call

CHILD = r"""
import collections, json, sys
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
events = collections.Counter()
jax.monitoring.register_event_listener(lambda name, **kw: events.update([name]))
jax.monitoring.register_event_duration_secs_listener(lambda name, secs, **kw: events.update([name]))
from pdserve.server.prefill import host_call

def affine(inputs, outputs, param):  # y = x * a + b
    (x, b), (y,) = inputs, outputs
    y.copy_(x * float(param) + b)

host_call.register("test_affine", affine)
f = jax.jit(lambda x, b: host_call.call("test_affine", "3.0", [x * 2, b], [jax.core.ShapedArray(x.shape, x.dtype)])[0])
y = f(jnp.arange(6, dtype=jnp.float32).reshape(2, 3), jnp.float32(1))
print(json.dumps({"y": np.asarray(y).tolist(), "why": host_call.load(), "compiled": events[
    "/jax/core/compile/backend_compile_duration"] - events["/jax/compilation_cache/cache_hits"],
    "from_cache": events["/jax/compilation_cache/cache_hits"]}))
"""
WANT = [[1.0, 7.0, 13.0], [19.0, 25.0, 31.0]]


def _child(cache: str, **env: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, cache], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_next_process_reads_a_host_calling_program_from_the_cache(tmp_path):
    first, second = _child(str(tmp_path / "xla")), _child(str(tmp_path / "xla"))
    assert first["why"] is None and first["y"] == WANT and first["compiled"] >= 1 and first["from_cache"] == 0
    assert second["y"] == WANT and second["compiled"] == 0 and second["from_cache"] == first["compiled"]


def test_without_a_compiler_the_ops_run_as_python_callbacks(tmp_path):
    got = _child(str(tmp_path / "xla"), CXX=str(tmp_path / "no-such-c++"), PDSERVE_KERNEL_CACHE=str(tmp_path / "k"))
    assert got["y"] == WANT
    assert "no C++ compiler" in got["why"] and "compile at every start" in got["why"]


def test_ops_read_and_write_the_buffers_in_place_with_their_dtypes_and_shapes():
    seen = {}

    def record(inputs, outputs, param):
        seen.update(param=param, dtypes=[str(t.dtype) for t in inputs + outputs],
                    shapes=[tuple(t.shape) for t in inputs + outputs])
        outputs[0].copy_(inputs[0].float().sum(dim=1))
        outputs[1].copy_(inputs[1] + 1)
        outputs[2].zero_()

    host_call.register("test_record", record)
    x = jnp.asarray(np.arange(12).reshape(3, 4), jnp.bfloat16)
    ids = jnp.asarray([5, 7], jnp.int32)
    out = [jax.core.ShapedArray((3,), jnp.float32), jax.core.ShapedArray((2,), jnp.int32),
           jax.core.ShapedArray((0, 4), jnp.bfloat16)]
    total, bumped, empty = jax.jit(lambda x, ids: host_call.call("test_record", "p q", [x, ids], out))(x, ids)
    assert np.asarray(total).tolist() == [6.0, 22.0, 38.0] and np.asarray(bumped).tolist() == [6, 8]
    assert empty.shape == (0, 4)
    assert seen == {"param": "p q", "dtypes": ["torch.bfloat16", "torch.int32", "torch.float32", "torch.int32",
                                               "torch.bfloat16"], "shapes": [(3, 4), (2,), (3,), (2,), (0, 4)]}


def test_an_op_that_raises_fails_the_call_with_its_message():
    def broken(inputs, outputs, param):
        raise ValueError("weight 12 is not held here")

    host_call.register("test_broken", broken)
    f = jax.jit(lambda x: host_call.call("test_broken", "", [x], [jax.core.ShapedArray(x.shape, x.dtype)])[0])
    with pytest.raises(Exception, match="test_broken.*ValueError: weight 12 is not held here"):
        jax.block_until_ready(f(jnp.ones(3)))


def test_op_names_hold_no_spaces():
    with pytest.raises(ValueError, match="no spaces"):
        host_call.register("two words", lambda i, o, p: None)
