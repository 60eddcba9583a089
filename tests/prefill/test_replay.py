"""The replay channel of a prefill slice (replay.py) in one process: a follower receives exactly the
steps process 0 sends, stops when told, and either side's loss reaches the other; an engine that only
replays the steps computes exactly what process 0's engine computes."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import ml_dtypes
import numpy as np
import pytest

from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.server.prefill.model import Packing
from pdserve.server.prefill.replay import KEY, SliceLeader, follow
from pdserve.server.prefill.step_inputs import StepInputs


class Store:
    """JAX's key-value store, in memory."""

    def __init__(self):
        self.values: dict[str, str] = {}

    def publish(self, key: str, value: str) -> None:
        self.values[key] = value

    def lookup(self, key: str) -> str:
        return self.values[key]


def step(n: int) -> StepInputs:
    """A step of 16 token slots and 4 context slots, every kind of array set (n marks it)."""
    rng = np.random.default_rng(n)
    ints = lambda *shape: rng.integers(-2, 500, shape, dtype=np.int32)  # noqa: E731
    packing = Packing(ints(1, 16), ints(1, 16), ints(1, 4), ints(1, 4))
    context = rng.standard_normal((2, 2, 1, 4, 2, 8)).astype(ml_dtypes.bfloat16)  # [2, L, 1, C, Hkv, D]
    penalties = (ints(2, 16), ints(2), ints(2), rng.random(2, np.float32), rng.random(2, np.float32),
                 rng.random(2, np.float32), rng.random((2, 500)) < 0.1)
    sampling = (rng.random(2, np.float32), ints(2), rng.random(2, np.float32),
                rng.integers(0, 2**32, 2, dtype=np.uint32), ints(2), rng.random(2, np.float32))
    return StepInputs(ints(1, 16), packing, context, (("float32", 16), ("int8", 32)), np.array([3, 9], np.int32),
                      penalties, sampling, next_tokens=ints(1, 16) if n % 2 else None)


def assert_same(got: StepInputs, want: StepInputs) -> None:
    assert got.formats == want.formats
    assert got.arrays().keys() == want.arrays().keys()
    for name, a in want.arrays().items():
        b = got.arrays()[name]
        assert (b.dtype, b.shape) == (a.dtype, a.shape), name
        assert a.tobytes() == b.tobytes(), name


def start_follower(store: Store, secret: str | None = None, run=None, process: int = 1):
    """follow() in a thread; returns (thread, steps it ran, what it reported lost)."""
    ran, lost = [], []
    thread = threading.Thread(target=follow, args=(run or ran.append, process, secret),
                              kwargs=dict(lookup=store.lookup, on_lost=lost.append), daemon=True)
    thread.start()
    return thread, ran, lost


def test_a_follower_runs_exactly_the_steps_sent_then_stops_when_told():
    store, leader_lost = Store(), []
    leader = SliceLeader.listen(2, "127.0.0.1", "s3cret", publish=store.publish, on_lost=leader_lost.append)
    assert json.loads(store.values[KEY])["address"] == leader.address
    followers = [start_follower(store, "s3cret", process=p) for p in (2, 1)]
    leader.accept(timeout=30)
    sent = [step(n) for n in range(3)]
    assert [leader.run(s, dispatch=lambda inputs: inputs.tokens.sum()) for s in sent] == [s.tokens.sum() for s in sent]
    leader.stop()
    for thread, ran, lost in followers:
        thread.join(30)
        assert not thread.is_alive() and lost == []
        assert len(ran) == 3
        for got, want in zip(ran, sent):
            assert_same(got, want)
    assert sent[0].next_tokens is None and ran[0].next_tokens is None  # absent stays absent
    assert leader_lost == []
    with pytest.raises(RuntimeError, match="stopping"):
        leader.run(sent[0], dispatch=lambda inputs: None)


def test_a_follower_without_the_token_and_secret_is_refused():
    store = Store()
    leader = SliceLeader.listen(1, "127.0.0.1", "s3cret", publish=store.publish, on_lost=lambda why: None)
    _, ran, _ = start_follower(store, "another secret")
    with pytest.raises(TimeoutError, match=r"processes \[1\] of the prefill slice did not connect"):
        leader.accept(timeout=3)
    leader.stop()
    assert ran == []


def test_a_follower_that_fails_a_step_ends_itself_and_then_process_0():
    store, leader_lost = Store(), []
    leader = SliceLeader.listen(1, "127.0.0.1", publish=store.publish, on_lost=leader_lost.append)

    def run(inputs: StepInputs) -> None:
        raise MemoryError("out of device memory")

    thread, _, lost = start_follower(store, run=run)
    leader.accept(timeout=30)
    leader.run(step(0), dispatch=lambda inputs: None)
    thread.join(30)
    assert lost == ["process 1 failed a step (MemoryError('out of device memory'))"]
    for _ in range(600):  # the leader's watcher sees the connection end
        if leader_lost:
            break
        time.sleep(0.05)
    assert leader_lost == ["process 1 stopped (its replay connection to process 0 closed)"]
    leader.stop()


def test_process_0_gone_without_a_stop_ends_a_follower():
    """Process 0 dies (its socket closes) after the follower's hello: the follower reports it."""
    listener = socket.create_server(("127.0.0.1", 0))
    store = Store()
    store.publish(KEY, json.dumps({"address": f"127.0.0.1:{listener.getsockname()[1]}", "token": "00" * 32}))
    thread, ran, lost = start_follower(store)
    conn, _ = listener.accept()
    conn.recv(4096)  # the hello
    conn.close()
    listener.close()
    thread.join(30)
    assert ran == [] and len(lost) == 1
    assert lost[0].startswith("process 0's replay connection closed without a stop")


def _host(out) -> list[np.ndarray]:
    """A step's outputs on the host, in a fixed order."""
    arrays = [out.first, out.logits, *(out.prompt_logprobs or ())]
    for _, wire, k, v in out.kv:
        arrays += [k, v, *(a for f in sorted(wire) for a in wire[f])]
    return [np.asarray(a) for a in arrays if a is not None]


async def test_an_engine_that_only_replays_the_steps_computes_what_process_0_computes(tiny_model):
    """What each process of a slice relies on: a step's inputs carry everything it reads (earlier
    chunks' KV, a cached prefix, penalties, prompt-logprob targets, drawn sampling seeds), so a second
    engine that keeps no state of its own computes the same outputs, bit for bit."""
    from tests.prefill.test_engine import GREEDY, _engine

    path = tiny_model("qwen2")
    kw = dict(max_prefill_chunk=32, max_batch_tokens=64, max_model_len=256)
    leader, follower = _engine(path, **kw), _engine(path, **kw)
    store, lost_by_leader = Store(), []
    leader.replay = SliceLeader.listen(1, "127.0.0.1", publish=store.publish, on_lost=lost_by_leader.append)
    ours, theirs = [], []
    dispatch = leader.dispatch

    def recorded(inputs: StepInputs, to_host: bool = True):
        out = dispatch(inputs, to_host)
        ours.append(_host(out))
        return out

    leader.dispatch = recorded  # type: ignore[method-assign]
    thread, _, lost = start_follower(store, run=lambda inputs: theirs.append(_host(follower.dispatch(inputs, False))))
    leader.replay.accept(timeout=30)
    penalized = gen_pb.SamplingParams(max_tokens=4, temperature=0.0, repetition_penalty=1.5, min_tokens=2)
    sampled = gen_pb.SamplingParams(max_tokens=4, temperature=0.9)  # no seed: process 0 draws one
    with_logprobs = gen_pb.SamplingParams(max_tokens=4, temperature=0.0, logprobs=2, prompt_logprobs=1)
    prompts = [(list(range(3, 8)), GREEDY, "float32"), (list(range(3, 80)), penalized, "int8"),
               (list(range(9, 30)), sampled, "bfloat16"), (list(range(40, 90)), with_logprobs, "float32")]
    await asyncio.gather(*(leader.submit(p, sp, 0, dtype) for p, sp, dtype in prompts))
    await leader.submit(list(range(3, 80)), GREEDY, 0, "fp8_e4m3")  # its first 64 tokens from the prefix KV
    assert leader.prefix.hits == 64
    leader.close()
    thread.join(30)
    assert not thread.is_alive() and lost == [] and lost_by_leader == []
    assert len(theirs) == len(ours) >= 5  # chunks of 32 in steps of 64 tokens
    for step_ours, step_theirs in zip(ours, theirs):
        assert len(step_ours) == len(step_theirs)
        for a, b in zip(step_ours, step_theirs):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a, b)
