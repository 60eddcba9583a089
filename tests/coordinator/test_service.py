"""The coordinator end to end through its public API, against scripted in-process workers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import prometheus_client
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.v1 import generation_pb2, generation_pb2_grpc
from pdserve.server.coordinator.config import CoordinatorConfig
from pdserve.server.coordinator.main import Coordinator, start
from pdserve.server.model.tokenizer import Tokenizer
from tests.coordinator.fakes import LAYOUT, FakeDecode, FakePrefill, FakeWorker, fake_logprob, wait_for

FinishReason = generation_pb2.FinishReason
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
EOS = 0  # the tiny tokenizer's <|endoftext|>


@dataclass
class Cluster:
    coordinator: Coordinator
    prefill: FakePrefill
    decode: FakeDecode
    prefill_worker: FakeWorker
    decode_worker: FakeWorker
    stub: generation_pb2_grpc.GenerationStub
    health: health_pb2_grpc.HealthStub
    tokenizer: Tokenizer

    def script(
        self, ids: list[int], chunks: list[int], finish: int | None = FinishReason.FINISH_REASON_LENGTH
    ):
        """The output will be `ids`: the first from prefill, the rest in events of the given sizes."""
        assert sum(chunks) == len(ids) - 1
        self.prefill.first_token_id = ids[0]
        events, at = [], 1
        for n in chunks:
            events.append(ids[at : at + n])
            at += n
        self.decode.events = events
        self.decode.finish = finish
        return events


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("llama")


async def _coordinator(model_dir, prefill: list[str], decode: list[str], max_coalesce: int | None = 1,
                       **config) -> Coordinator:
    """max_coalesce 1 by default: one response per decode event, so the tests can script their boundaries
    (None: the coordinator's default)."""
    config = CoordinatorConfig(
        model_dir,
        port=0,
        prefill_addresses=prefill,
        decode_addresses=decode,
        refresh_seconds=0.1,
        lease_seconds=5,
        **({} if max_coalesce is None else {"max_coalesce": max_coalesce}),
        **config,
    )
    return await start(config)


@contextlib.asynccontextmanager
async def _cluster(model_dir, steps: bool = False, max_coalesce: int | None = 1, **config) -> AsyncIterator[Cluster]:
    """steps: the fake decode worker serves `Steps` (each request's events in one StepBatch); config: more
    CoordinatorConfig fields."""
    decode, prefill = FakeDecode(), FakePrefill()
    decode.steps = steps
    decode_worker = await FakeWorker.start("decode", decode)
    prefill_worker = await FakeWorker.start("prefill", prefill)
    prefill.decoders[decode_worker.address] = decode
    coordinator = await _coordinator(model_dir, [prefill_worker.address], [decode_worker.address], max_coalesce,
                                     **config)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{coordinator.port}")
    try:
        yield Cluster(
            coordinator,
            prefill,
            decode,
            prefill_worker,
            decode_worker,
            generation_pb2_grpc.GenerationStub(channel),
            health_pb2_grpc.HealthStub(channel),
            Tokenizer.from_dir(model_dir),
        )
    finally:
        await channel.close()
        await coordinator.stop(0)
        await prefill_worker.stop()
        await decode_worker.stop()


@pytest.fixture
async def cluster(model_dir):
    async with _cluster(model_dir) as c:
        yield c


def request(text: str = "import os", **sampling) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(text=text, sampling=generation_pb2.SamplingParams(**sampling))


async def generate(
    cluster: Cluster, req: generation_pb2.GenerateRequest
) -> list[generation_pb2.GenerateResponse]:
    return [r async for r in cluster.stub.Generate(req, timeout=10)]


async def status(cluster: Cluster, service: str = "") -> int:
    return (await cluster.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)).status


async def test_streams_first_token_from_prefill_then_decode_events(cluster: Cluster):
    text = "Hello, world! 你好 😀 done"
    ids = cluster.tokenizer.encode(text)
    events = cluster.script(ids, [2, 1, 7, 3, len(ids) - 14])
    req = request("import os", max_tokens=len(ids))
    req.request_id = "r-1"
    responses = await generate(cluster, req)

    assert [list(r.token_ids) for r in responses] == [[ids[0]], *events, []]
    assert "".join(r.text for r in responses) == text
    assert all("\ufffd" not in r.text for r in responses)
    assert [r.finish_reason for r in responses] == [0] * 6 + [FinishReason.FINISH_REASON_LENGTH]
    assert {r.request_id for r in responses} == {"r-1"}
    final = responses[-1]
    prompt = cluster.tokenizer.encode("import os")
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (len(prompt), len(ids))
    assert not any(r.HasField("usage") for r in responses[:-1])


async def test_workers_get_one_transfer_token_the_decode_target_and_explicit_defaults(cluster: Cluster):
    cluster.script([5, 6, 7], [2])
    await generate(cluster, request("import os"))
    prompt = cluster.tokenizer.encode("import os")
    (dreq,), (preq,) = cluster.decode.requests, cluster.prefill.requests
    # workers get the request id plus a suffix unique to this call: clients may reuse ids
    client_id, suffix = dreq.request_id.split(".")
    assert len(client_id) == 32 and len(suffix) == 8 and dreq.request_id == preq.request_id
    assert (dreq.attempt, preq.attempt, preq.sample_index, dreq.num_output_tokens) == (0, 0, 0, 0)
    assert list(dreq.prompt_token_ids) == list(preq.token_ids) == prompt
    assert len(dreq.transfer_token) == 16 and dreq.transfer_token == preq.transfer_token
    assert dreq.lease_seconds == 5.0
    assert preq.target.address == cluster.decode_worker.address
    assert preq.target.layout == LAYOUT
    for sampling in (dreq.sampling, preq.sampling):
        assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.top_k) == (
            16,
            1.0,
            1.0,
            0,
        )
        assert not sampling.HasField("seed")
    assert cluster.decode.completed.is_set() and not cluster.decode.cancelled.is_set()

    await generate(cluster, request("import os", seed=7, temperature=0.0, top_k=5, stop=["x"]))
    sampling = cluster.decode.requests[1].sampling
    assert (sampling.seed, sampling.temperature, sampling.top_k, list(sampling.stop)) == (7, 0.0, 5, ["x"])
    assert cluster.decode.requests[1].transfer_token != dreq.transfer_token


async def test_eos_is_in_the_ids_but_not_the_text(cluster: Cluster):
    ids = [*cluster.tokenizer.encode(" done"), EOS]
    cluster.script(ids, [len(ids) - 1], FinishReason.FINISH_REASON_STOP)
    responses = await generate(cluster, request())
    assert [i for r in responses for i in r.token_ids] == ids
    assert "".join(r.text for r in responses) == " done"
    assert responses[-1].finish_reason == FinishReason.FINISH_REASON_STOP
    assert responses[-1].usage.completion_tokens == len(ids)


async def test_special_tokens_are_text_when_the_request_says_not_to_skip_them(cluster: Cluster):
    ids = [*cluster.tokenizer.encode(" done"), EOS]
    cluster.script(ids, [len(ids) - 1], FinishReason.FINISH_REASON_STOP)
    responses = await generate(cluster, request(skip_special_tokens=False))
    assert "".join(r.text for r in responses) == " done" + cluster.tokenizer.decode([EOS], skip_special_tokens=False)
    assert cluster.tokenizer.decode([EOS], skip_special_tokens=False) == "<|endoftext|>"


async def test_stop_string_across_tokens_cuts_the_text_and_cancels_decode(cluster: Cluster):
    tok = cluster.tokenizer
    head, stop, tail = tok.encode("The answer is 42. "), tok.encode("你好"), tok.encode(" more text")
    assert len(stop) == 6  # one token per byte
    ids, n = [*head, *stop, *tail], len(head)
    # Events: the head but its last token | that token and 3 bytes of 你 | the rest (the stop ends at n+5).
    events = cluster.script(ids, [n - 2, 4, len(ids) - n - 3], finish=None)
    responses = await generate(cluster, request(stop=["你好", "zzz"], max_tokens=40))

    assert "".join(r.text for r in responses) == "The answer is 42. "
    assert [list(r.token_ids) for r in responses] == [[ids[0]], events[0], events[1], ids[n + 3 : n + 6]]
    final = responses[-1]
    assert final.finish_reason == FinishReason.FINISH_REASON_STOP
    assert final.usage.completion_tokens == n + 6
    assert await wait_for(cluster.decode.cancelled)


async def test_text_that_may_start_a_stop_string_is_held_back_until_it_cannot(cluster: Cluster):
    ids = [cluster.tokenizer.encode(c)[0] for c in "a STOP c"]  # one token per character
    cluster.script(ids, [1] * 7, FinishReason.FINISH_REASON_LENGTH)
    responses = await generate(cluster, request(stop=["STOX"]))
    assert [r.text for r in responses] == ["a", " ", "", "", "", "STOP", " ", "c", ""]
    assert responses[-1].finish_reason == FinishReason.FINISH_REASON_LENGTH


async def test_stop_string_in_the_first_token_ends_at_once(cluster: Cluster):
    ids = cluster.tokenizer.encode("a STOP c")
    cluster.script(ids, [len(ids) - 1], finish=None)
    responses = await generate(cluster, request(stop=["a"]))
    assert [(list(r.token_ids), r.text, r.finish_reason) for r in responses] == [
        ([ids[0]], "", FinishReason.FINISH_REASON_STOP)
    ]
    assert responses[0].usage.completion_tokens == 1
    assert await wait_for(cluster.decode.cancelled)


async def test_client_cancel_mid_stream_cancels_the_decode_call(cluster: Cluster):
    cluster.script([5, 6, 7, 8], [1, 2], finish=None)
    call = cluster.stub.Generate(request())
    got = [await call.read() for _ in range(3)]
    assert [list(r.token_ids) for r in got] == [[5], [6], [7, 8]]
    call.cancel()
    assert await wait_for(cluster.decode.cancelled)
    for _ in range(50):
        if all(w.inflight == 0 for w in cluster.coordinator.pool.workers.values()):
            break
        await asyncio.sleep(0.02)
    assert [w.inflight for w in cluster.coordinator.pool.workers.values()] == [0, 0]


async def test_client_deadline_cancels_a_pending_prefill_and_the_decode_call(cluster: Cluster):
    cluster.prefill.hang = True
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await cluster.stub.Generate(request(), timeout=0.5).read()
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert await wait_for(cluster.prefill.cancelled)
    assert await wait_for(cluster.decode.cancelled)


@pytest.mark.parametrize(
    "req, field",
    [
        (generation_pb2.GenerateRequest(text=""), "prompt"),
        (generation_pb2.GenerateRequest(), "prompt"),
        (generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[])), "prompt"),
        (request(max_tokens=0), "max_tokens"),
        (request(max_tokens=510), "max_tokens"),
        (request(temperature=-0.5), "temperature"),
        (request(top_p=0.0), "top_p"),
        (request(top_p=1.5), "top_p"),
        (request(top_k=-1), "top_k"),
        (generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[3, 512])), "token_ids"),
        (generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[-1])), "token_ids"),
        (request(stop=[str(i) for i in range(17)]), "stop"),
        (request(stop=["a", ""]), "stop"),
    ],
)
async def test_bad_input_is_invalid_argument_naming_the_field_and_harms_nothing(cluster: Cluster, req, field):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await generate(cluster, req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(field)
    assert cluster.decode.requests == [] and cluster.prefill.requests == []

    cluster.script([5, 6], [1])
    responses = await generate(cluster, request())
    assert [i for r in responses for i in r.token_ids] == [5, 6]


async def test_too_long_names_both_numbers_and_the_limit(cluster: Cluster):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await generate(
            cluster,
            generation_pb2.GenerateRequest(
                token_ids=generation_pb2.TokenIds(ids=[7] * 500),
                sampling=generation_pb2.SamplingParams(max_tokens=13),
            ),
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == (
        "max_tokens 13 + a prompt of 500 tokens = 513 exceeds the model's max_model_len 512"
    )


async def test_a_decode_worker_refusing_for_room_is_picked_again_not_the_clients_failure(cluster: Cluster):
    """Another coordinator replica took its blocks first: the worker refuses; this one waits for its next
    load report and picks again."""
    def refusals() -> float:
        return sum(s.value for m in prometheus_client.REGISTRY.collect() if m.name == "pdserve_decode_refusals"
                   for s in m.samples if s.name == "pdserve_decode_refusals_total")

    before = refusals()
    cluster.decode.refuse, cluster.decode.refuse_calls = grpc.StatusCode.RESOURCE_EXHAUSTED, 2
    cluster.script([5, 6, 7], [1, 1])
    responses = await generate(cluster, request())
    assert [list(r.token_ids) for r in responses] == [[5], [6], [7], []]
    assert len(cluster.decode.requests) == 3
    assert refusals() - before == 2
    assert len(cluster.prefill.requests) == 1  # the prefill goes out once the blocks are held


async def test_decode_worker_dying_mid_stream_is_unavailable_naming_it(cluster: Cluster):
    cluster.script([5, 6, 7, 8], [1, 1, 1])
    cluster.decode.die_after = 2
    call = cluster.stub.Generate(request(), timeout=10)
    got = [await call.read() for _ in range(3)]
    assert [list(r.token_ids) for r in got] == [[5], [6], [7]]
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call.read()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"decode worker {cluster.decode_worker.address}" in e.value.details()
    for _ in range(50):
        if await status(cluster) == NOT_SERVING:
            break
        await asyncio.sleep(0.02)
    assert await status(cluster) == NOT_SERVING


async def test_decode_error_is_internal_with_its_message(cluster: Cluster):
    cluster.script([5, 6], [1], FinishReason.FINISH_REASON_ERROR)
    cluster.decode.finish_message = "KV handshake: fingerprint mismatch"
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await generate(cluster, request())
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert (
        e.value.details()
        == f"decode worker {cluster.decode_worker.address}: KV handshake: fingerprint mismatch"
    )


async def test_prefill_failure_frees_the_decode_reservation(cluster: Cluster):
    cluster.prefill.fail = grpc.StatusCode.INTERNAL
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await generate(cluster, request())
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert await wait_for(cluster.decode.cancelled)


async def test_health_is_serving_with_both_workers_and_follows_them(cluster: Cluster):
    assert await status(cluster) == SERVING
    assert await status(cluster, "pdserve.v1.Generation") == SERVING
    cluster.decode_worker.control.healthy = False
    await asyncio.sleep(0.35)
    assert await status(cluster) == NOT_SERVING
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await generate(cluster, request())
    assert (e.value.code(), e.value.details()) == (grpc.StatusCode.UNAVAILABLE, "no ready decode worker")
    cluster.decode_worker.control.healthy = True
    await asyncio.sleep(0.35)
    assert await status(cluster, "pdserve.v1.Generation") == SERVING


async def test_no_workers_is_unavailable_and_not_serving(model_dir):
    coordinator = await _coordinator(model_dir, [], [])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{coordinator.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "pdserve.v1.Generation"):
            answer = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert answer.status == NOT_SERVING
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await generation_pb2_grpc.GenerationStub(channel).Generate(request(), timeout=5).read()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert e.value.details() == "no ready decode worker"
    await coordinator.stop(0)


async def test_unreachable_workers_are_not_serving(model_dir):
    coordinator = await _coordinator(model_dir, ["127.0.0.1:1"], ["127.0.0.1:2"])
    assert [w.ready for w in coordinator.pool.workers.values()] == [False, False]
    assert not coordinator.pool.serving
    await coordinator.stop(0)


async def test_concurrent_requests_each_get_their_own_stream(cluster: Cluster):
    ids = cluster.tokenizer.encode("Hello, world! 你好")
    cluster.script(ids, [3, len(ids) - 4], FinishReason.FINISH_REASON_LENGTH)
    bad = generate(cluster, request(top_k=-2))
    results = await asyncio.gather(
        *(generate(cluster, request()) for _ in range(8)), bad, return_exceptions=True
    )
    for responses in results[:8]:
        assert [i for r in responses for i in r.token_ids] == ids
        assert "".join(r.text for r in responses) == "Hello, world! 你好"
    assert len({responses[0].request_id for responses in results[:8]}) == 8
    assert isinstance(results[8], grpc.aio.AioRpcError)
    assert results[8].code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len({r.transfer_token for r in cluster.decode.requests}) == 8


async def test_serve_logs_its_address_and_stops_when_cancelled(model_dir, caplog):
    import logging
    import signal

    from pdserve.server.coordinator.main import serve

    caplog.set_level(logging.INFO, logger="pdserve.coordinator")
    ready = asyncio.Event()
    task = asyncio.create_task(serve(CoordinatorConfig(model_dir, port=0), ready))
    try:
        assert await wait_for(ready)
        lines = [
            r.getMessage() for r in caplog.records if r.getMessage().startswith("coordinator listening on")
        ]
        assert len(lines) == 1 and lines[0].startswith("coordinator listening on 127.0.0.1:")
        port = int(lines[0].rsplit(":", 1)[1])
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            answer = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            assert answer.status == NOT_SERVING
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def test_routing_prefers_free_blocks_then_idle_decode_and_least_queued_prefill():
    from pdserve.v1 import worker_pb2
    from pdserve.server.coordinator.router import Router
    from pdserve.server.coordinator.worker_pool import Worker, WorkerPool

    def info(role: str, free: int = 0, queued: int = 0) -> worker_pb2.WorkerInfo:
        load = worker_pb2.WorkerLoad(free_kv_blocks=free, total_kv_blocks=100, queued_prefill_tokens=queued)
        return worker_pb2.WorkerInfo(role=role, kv_layout=LAYOUT, load=load)

    pool = WorkerPool()
    router = Router(pool)
    d1 = pool.add(Worker("d:1", "decode", info("decode", free=10), inflight=0, ready=True))
    d2 = pool.add(Worker("d:2", "decode", info("decode", free=50), inflight=3, ready=True))
    d3 = pool.add(Worker("d:3", "decode", info("decode", free=50), inflight=1, ready=True))
    pool.add(Worker("d:4", "decode", info("decode", free=99), ready=False))
    p1 = pool.add(Worker("p:1", "prefill", info("prefill", queued=100), ready=True))
    p2 = pool.add(Worker("p:2", "prefill", info("prefill", queued=7), inflight=2, ready=True))
    p3 = pool.add(Worker("p:3", "prefill", info("prefill", queued=7), inflight=1, ready=True))
    def pick_prefill() -> Worker | None:  # as the service picks (after its in-flight cap)
        return router.prefill_policy(pool.ready("prefill"))

    assert (router.pick_decode(), pick_prefill()) == (d3, p3)
    d3.ready, p3.ready = False, False
    assert (router.pick_decode(), pick_prefill()) == (d2, p2)
    d2.info.load.free_kv_blocks = 5
    assert router.pick_decode() is d1
    # blocks this coordinator reserved since the last GetInfo count as taken
    d2.info.load.free_kv_blocks = 50
    d2.reserved_blocks = 60  # more than GetInfo saw in use (50)
    assert d2.free_kv_blocks() == 40 and router.pick_decode() is d2
    d2.reserved_blocks = 95
    assert d2.free_kv_blocks() == 5 and router.pick_decode() is d1
    p2.pending_tokens = 20
    assert p2.queued_prefill_tokens() == 20 and pick_prefill() is p2  # p1 still queues 100
    p2.ready, p1.ready = False, False
    assert pick_prefill() is None
    assert pool.serving  # decode workers prefill locally when no prefill worker is alive
    d1.ready, d2.ready = False, False
    assert router.pick_decode() is None and not pool.serving
    await pool.close()


async def test_a_decode_pick_is_counted_while_the_request_waits_for_a_prefill_slot(cluster: Cluster):
    coordinator = cluster.coordinator
    coordinator.service.router.prefill_inflight_per_worker = 0  # every prefill worker is full: the request waits
    call = cluster.stub.Generate(request("import os", max_tokens=100), timeout=5)
    read = asyncio.ensure_future(call.read())
    decode = coordinator.pool.workers[cluster.decode_worker.address]
    for _ in range(200):
        if coordinator.service.router.prefill_queue.waiting:
            break
        await asyncio.sleep(0.01)
    # counted at pick time, before any decode call: one prompt block, not prompt + max_tokens
    assert (decode.inflight, decode.reserved_blocks, cluster.decode.requests) == (1, 1, [])
    call.cancel()
    with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
        await read
    for _ in range(200):
        if not decode.inflight:
            break
        await asyncio.sleep(0.01)
    assert (decode.inflight, decode.reserved_blocks) == (0, 0)


async def test_queued_events_from_a_decode_worker_keep_the_stream_and_change_nothing(cluster: Cluster):
    text = "import os, sys"
    ids = cluster.tokenizer.encode(text)
    events = cluster.script(ids, [1, len(ids) - 2])
    cluster.decode.queued = 2
    responses = await generate(cluster, request("import os", max_tokens=len(ids)))
    assert [list(r.token_ids) for r in responses] == [[ids[0]], *events, []]
    assert "".join(r.text for r in responses) == text


# ---- adaptive coalescing: steps that piled up go out together -------------------------------------


def _joined(responses: list[generation_pb2.GenerateResponse]) -> tuple[list[int], str, int, int, str]:
    """What the client ends up with: every id, the text, the finish reason, the usage, the stop string."""
    final = responses[-1]
    return ([i for r in responses for i in r.token_ids], "".join(r.text for r in responses), final.finish_reason,
            final.usage.completion_tokens, final.stop_string)


@pytest.mark.parametrize("max_coalesce", [None, 3, 1])
async def test_steps_that_piled_up_go_out_together_with_the_same_tokens_and_text(model_dir, max_coalesce):
    """A StepBatch carrying several steps of a request (the worker ran ahead of the coordinator): by default
    one response carries them all; --max-coalesce N at most N ids each; 1 one response per step. The ids,
    the text (split multi-byte characters included), the finish and the usage are the same every way."""
    async with _cluster(model_dir, steps=True, max_coalesce=max_coalesce) as cluster:
        text = "Hello, world! 你好 😀 done"
        ids = cluster.tokenizer.encode(text)
        cluster.script(ids, [1] * (len(ids) - 1))  # one step per id
        responses = await generate(cluster, request(max_tokens=len(ids)))
        assert cluster.decode.requests[0].steps_stream_id  # it rode the Steps stream

    per = len(ids) - 1 if max_coalesce is None else max_coalesce
    rest = ids[1:]
    assert [list(r.token_ids) for r in responses] == [
        [ids[0]], *[rest[k : k + per] for k in range(0, len(rest), per)], []]
    assert _joined(responses) == (ids, text, FinishReason.FINISH_REASON_LENGTH, len(ids), "")
    assert all("\ufffd" not in r.text for r in responses)


@pytest.mark.parametrize("max_coalesce", [None, 1])
async def test_a_stop_string_in_coalesced_steps_cuts_at_the_same_token_and_text(model_dir, max_coalesce):
    async with _cluster(model_dir, steps=True, max_coalesce=max_coalesce) as cluster:
        tok = cluster.tokenizer
        head, stop, tail = tok.encode("The answer is 42. "), tok.encode("你好"), tok.encode(" more text")
        ids, n = [*head, *stop, *tail], len(head)
        cluster.script(ids, [1] * (len(ids) - 1), finish=None)
        responses = await generate(cluster, request(stop=["你好", "zzz"], max_tokens=40))
        assert await wait_for(cluster.decode.cancelled)  # the stop string ended the decode call

    assert _joined(responses) == (ids[: n + 6], "The answer is 42. ", FinishReason.FINISH_REASON_STOP, n + 6, "你好")
    assert len(responses) == (2 if max_coalesce is None else n + 6)  # the first token's, then one with the rest


async def test_coalesced_steps_keep_each_tokens_logprob_in_order(model_dir):
    async with _cluster(model_dir, steps=True, max_coalesce=None) as cluster:
        ids = cluster.tokenizer.encode(" print('hello')")
        cluster.script(ids, [1] * (len(ids) - 1))
        responses = await generate(cluster, request(max_tokens=len(ids), logprobs=1))

    assert [list(r.token_ids) for r in responses] == [[ids[0]], ids[1:], []]
    assert [lp for r in responses for lp in r.logprobs] == [fake_logprob(i, 1) for i in ids]


@pytest.mark.parametrize("steps", [False, True])
async def test_a_decode_worker_silent_for_the_stall_timeout_is_lost(model_dir, steps):
    """After its first events the worker sends nothing more: past --stall-timeout the stream is lost (the
    worker marked failed, the request migrated until no worker is left), never left hanging."""
    async with _cluster(model_dir, steps=steps, stall_timeout=0.3) as cluster:
        cluster.script([5, 6], [1], finish=None)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await generate(cluster, request(max_tokens=10))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "sent nothing for 0.3 s (--stall-timeout)" in e.value.details()
