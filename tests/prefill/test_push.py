"""The prefill worker's KV push: layer group by layer group, an attempt that dies half way, the push
bound. A real PrefillService and engine on a tiny model, the in-memory transport, a real KvReceiver."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import numpy as np
import pytest

from pdserve.kvcache.codec import kv_bytes
from pdserve.kvcache.layout import KvLayout
from pdserve.kvcache.local import LocalKvTransport
from pdserve.kvcache.receiver import KvReceiver, TransferError
from pdserve.v1 import worker_pb2 as pb
from pdserve.server.model.config import load_config
from pdserve.server.model.fingerprint import fingerprint
from pdserve.server.model.weights import load_weights
from pdserve.server.prefill.config import PrefillConfig
from pdserve.server.prefill.engine import PrefillEngine
from pdserve.server.prefill.model import load_params
from pdserve.server.prefill.service import PrefillService, ttft_due

from .test_engine import GREEDY

DECODE = "decode-0"
TOKEN = b"t" * 16
CHUNK = 2 * 2048 + 64  # two blocks of one layer (4 tokens x 2 heads x 32 x fp32 x k, v) per message


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class Context:
    async def abort(self, code, details=""):
        raise Aborted(code, details)


class Sink:
    """Records (request id, piece, when) and can hold each write for a while (a slow cache)."""

    def __init__(self, delay: float = 0.0, on_write=None) -> None:
        self.writes: list = []
        self.delay, self.on_write = delay, on_write
        self._lock = threading.Lock()

    def write(self, request_id, piece) -> None:
        if self.on_write is not None:
            self.on_write()
        time.sleep(self.delay)
        with self._lock:
            self.writes.append((request_id, piece, time.monotonic()))

    def assemble(self, writes, layout: KvLayout, n: int) -> tuple[np.ndarray, np.ndarray]:
        k = np.zeros((layout.num_layers, n, layout.num_kv_heads, layout.head_dim), layout.np_dtype)
        v = np.zeros_like(k)
        for _, p, _ in writes:
            k[p.layer_start:p.layer_start + p.num_layers, p.token_start:p.token_start + p.num_tokens] = p.k
            v[p.layer_start:p.layer_start + p.num_layers, p.token_start:p.token_start + p.num_tokens] = p.v
        return k, v


class Rig:
    def __init__(self, path, sink: Sink, **config) -> None:
        # The tests compare with a first pass of the same prompt bit for bit: a prefix taken from the
        # prefix KV would round differently (test_chunks_leave_as_they_are_computed covers it).
        config.setdefault("prefix_cache_bytes", 0)
        self.model = load_config(path)
        self.engine = PrefillEngine(self.model, load_params(self.model, load_weights(path)),
                                    PrefillConfig(model_dir=path, **config))
        self.layout = KvLayout(self.model.num_layers, self.model.num_kv_heads, self.model.head_dim, 4, "float32")
        digest = fingerprint(path, self.model)
        self.receiver = KvReceiver(self.layout, digest, sink)
        self.service = PrefillService(self.engine, LocalKvTransport({DECODE: self.receiver}, num_streams=2,
                                                                       max_chunk_bytes=CHUNK),
                                      self.model, fingerprint=digest)

    def request(self, rid: str, ids: list[int], attempt: int = 0, token: bytes = TOKEN) -> pb.PrefillRequest:
        return pb.PrefillRequest(request_id=rid, attempt=attempt, token_ids=ids, sampling=GREEDY, transfer_token=token,
                                 target=pb.KvTarget(address=DECODE, layout=self.layout.to_proto()))

    async def prefill(self, rid: str, ids: list[int], attempt: int = 0) -> int:
        return (await self.service.Prefill(self.request(rid, ids, attempt), Context())).first_token_id


PROMPT = list(range(3, 30))  # 27 tokens: 7 blocks of 4, the last partial


async def test_kv_leaves_layer_group_by_group_and_equals_the_whole_prefill(tiny_model):
    path = tiny_model("llama")
    sink = Sink()
    rig = Rig(path, sink, kv_layer_groups=2)
    assert rig.engine.runner.groups == [(0, 1), (1, 1)]
    want = await rig.engine.submit(PROMPT, GREEDY, 0, "float32", 4)
    transfer = rig.receiver.expect("r1", 0, TOKEN, len(PROMPT))
    first = await rig.prefill("r1", PROMPT)
    assert first == want.first_token
    assert await asyncio.wait_for(transfer.done, 30) == first
    k, v = sink.assemble(sink.writes, rig.layout, len(PROMPT))
    np.testing.assert_array_equal(k, want.k)
    np.testing.assert_array_equal(v, want.v)
    layers = [p.layer_start for _, p, _ in sink.writes]
    assert sorted(layers) == [0] * 4 + [1] * 4  # 7 blocks of each layer in 4 pieces; each layer its own group
    assert transfer.started_at < min(t for _, _, t in sink.writes)  # the header came first: the lease ran


async def test_chunks_leave_as_they_are_computed_and_a_cached_prefix_leaves_first(tiny_model):
    path = tiny_model("llama")
    want = await Rig(path, Sink()).engine.submit(PROMPT, GREEDY, 0, "float32", 4)
    sink = Sink()
    rig = Rig(path, sink, kv_layer_groups=2, max_prefill_chunk=8, prefix_cache_bytes=1 << 20)
    for rid, prompt in (("r1", PROMPT), ("r2", PROMPT)):  # r2: its first 16 tokens from the prefix KV
        sink.writes.clear()
        transfer = rig.receiver.expect(rid, 0, TOKEN, len(prompt))
        assert await rig.prefill(rid, prompt) == want.first_token
        assert await asyncio.wait_for(transfer.done, 30) == want.first_token
        k, v = sink.assemble(sink.writes, rig.layout, len(prompt))
        np.testing.assert_allclose(k, want.k, atol=1e-5)
        np.testing.assert_allclose(v, want.v, atol=1e-5)
        starts = sorted({p.token_start for _, p, _ in sink.writes})
        # r1: a chunk of 8 tokens at a time; r2: the cached 16 tokens (all layers in one KvTensors, cut
        # into one-block pieces by the CHUNK byte limit), then its two computed chunks
        assert starts == ([0, 8, 16, 24] if rid == "r1" else [0, 4, 8, 12, 16, 24])
    assert rig.engine.prefix.hits == 16


async def test_a_prefill_that_dies_after_k_of_n_groups_aborts_and_the_retry_does_not_mix(tiny_model):
    path = tiny_model("llama")
    sink = Sink()
    rig = Rig(path, sink, kv_layer_groups=2)
    want = await rig.engine.submit(PROMPT, GREEDY, 0, "float32", 4)
    to_wire, calls = rig.engine.runner.to_wire, []

    def dying(*args, **kwargs):  # the first run's second group never reaches the host
        calls.append(1)
        arrays = to_wire(*args, **kwargs)
        return (DeviceLost(), *arrays[1:]) if len(calls) == 2 else arrays

    rig.engine.runner.to_wire = dying
    old = rig.receiver.expect("r1", 0, TOKEN, len(PROMPT))
    assert await rig.prefill("r1", PROMPT) == want.first_token  # the first token is out before the last group
    with pytest.raises(TransferError) as failure:
        await asyncio.wait_for(old.done, 5)
    assert failure.value.code == grpc.StatusCode.ABORTED
    assert str(failure.value) == (
        "the prefill worker gave up request 'r1' attempt 0: prefill failed: RuntimeError('device lost')"
    )
    await rig.receiver.settle("r1")  # as the decode worker does before it frees the attempt's blocks
    assert {p.layer_start for _, p, _ in sink.writes} <= {0}  # at most group 1 of 2 arrived
    dead_writes = len(sink.writes)

    new = rig.receiver.expect("r1", 1, TOKEN, len(PROMPT))  # the coordinator retries as attempt 1
    assert await rig.prefill("r1", PROMPT, attempt=1) == want.first_token
    assert await asyncio.wait_for(new.done, 30) == want.first_token
    retry = sink.writes[dead_writes:]
    assert len(retry) == 8  # every piece of the retry, nothing more
    k, v = sink.assemble(retry, rig.layout, len(PROMPT))
    np.testing.assert_array_equal(k, want.k)
    np.testing.assert_array_equal(v, want.v)


class DeviceLost:
    def __array__(self, *args, **kwargs):
        raise RuntimeError("device lost")


async def test_a_push_that_cannot_start_fails_the_prefill_call(tiny_model):
    rig = Rig(tiny_model("llama"), Sink())
    transfer = rig.receiver.expect("r1", 0, TOKEN, len(PROMPT))
    with pytest.raises(Aborted) as err:
        await rig.service.Prefill(rig.request("r1", PROMPT, token=b"forged" * 3), Context())
    assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert err.value.details == (
        "the KV push to decode worker decode-0 could not start: PERMISSION_DENIED: request 'r1': wrong transfer "
        "token; send the token the coordinator issued for this attempt"
    )
    assert not transfer.done.done() and rig.service.budget.pushes == 0


async def test_the_push_bound_holds_and_the_worker_takes_no_new_work_at_it(tiny_model):
    path = tiny_model("llama")
    prompts = [list(range(3 + i, 30 + i)) for i in range(6)]
    layout_bytes = kv_bytes(KvLayout(2, 2, 32, 4, "float32"), 27)
    held: list[int] = []
    sink = Sink(delay=0.01, on_write=lambda: held.append(rig.service.budget.bytes))
    rig = Rig(path, sink, max_batch_size=1, max_push_bytes=2 * layout_bytes + 100)
    transfers = [rig.receiver.expect(f"r{i}", 0, TOKEN, 27) for i in range(6)]
    firsts = await asyncio.gather(*(rig.prefill(f"r{i}", p) for i, p in enumerate(prompts)))
    assert [await asyncio.wait_for(t.done, 30) for t in transfers] == firsts
    await asyncio.gather(*rig.service.pushes)
    assert rig.service.budget.peak_bytes == 2 * layout_bytes  # reached, never passed
    assert max(held) == 2 * layout_bytes and rig.service.budget.bytes == 0
    too_long = list(range(3, 3 + 3 * 27))
    with pytest.raises(Aborted) as err:
        await rig.service.Prefill(rig.request("big", too_long), Context())
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.details == (
        f"the prompt's KV takes {kv_bytes(rig.layout, 81)} bytes on the host, over this prefill worker's "
        f"--max-push-bytes {2 * layout_bytes + 100}"
    )


def test_the_ttft_budget_the_coordinator_admitted_under_sets_when_the_first_token_is_due():
    request = pb.PrefillRequest(ttft_budget_seconds=30.0, arrived_seconds_ago=4.5)
    assert ttft_due(request, received=100.0) == 125.5
    assert ttft_due(pb.PrefillRequest(), received=100.0) is None  # an older coordinator: never urgent


async def test_a_prompt_is_queued_due_when_its_budget_ends_and_a_bad_budget_is_refused(tiny_model):
    rig = Rig(tiny_model("llama"), Sink())
    assert rig.service.info().prefill_deadlines
    buckets = rig.service.info().load.prefill_buckets  # idle: no wait for any length
    assert [b.expected_wait_seconds for b in buckets if b.HasField("expected_wait_seconds")] == [0.0] * len(buckets)
    dues: list[float | None] = []
    add = rig.engine.scheduler.add
    rig.engine.scheduler.add = lambda job, due=None: (dues.append(due), add(job, due))[1]
    request = rig.request("r1", PROMPT)
    request.ttft_budget_seconds, request.arrived_seconds_ago = 30.0, 4.5
    transfer = rig.receiver.expect("r1", 0, TOKEN, len(PROMPT))
    before = time.monotonic()
    await rig.service.Prefill(request, Context())
    after = time.monotonic()
    await asyncio.wait_for(transfer.done, 30)
    (due,) = dues
    assert before + 25.5 <= due <= after + 25.5
    request.arrived_seconds_ago = -1.0
    with pytest.raises(Aborted) as err:
        await rig.service.Prefill(request, Context())
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details == ("ttft_budget_seconds (30.0) and arrived_seconds_ago (-1.0) must be finite "
                                 "and >= 0 (0 and 0: no TTFT budget)")
