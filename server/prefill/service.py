"""The prefill worker's gRPC face: Prefill returns the first token while the KV streams to the decode worker.

Life of a Prefill call:
1. Check the target's KV format; load the request's LoRA adapter (from its path on a miss, lora.py); wait for room
   in the push budget (count and host bytes in flight).
2. Queue the prompt in the engine, due when the TTFT budget it was admitted under ends (`ttft_due`).
   When the engine begins it, the push opens its KV streams to the
   decode worker with the header: the decode worker's lease starts now, not while the prompt queued.
3. The call answers with the first token once the header was accepted; a push that could not start
   fails the call instead (the coordinator then frees the decode worker's blocks and retries).
4. The push sends each layer group as the engine finishes it, then KvEnd. A prefill that fails after
   the header sends KvAbort, so the decode worker frees its blocks at once. Then the budget is freed.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

import grpc
from pdserve.kvcache.adapter_key import AdapterKey
from pdserve.kvcache.codec import kv_bytes
from pdserve.kvcache.layout import NUMPY_DTYPES, KvLayout
from pdserve.kvcache.sender import KvSender, KvTransport
from pdserve.server import logs, metrics, request_checks
from pdserve.server.hardware import Hardware
from pdserve.server.model.config import ModelConfig
from pdserve.server.model.lora import LoraLoadError
from pdserve.server.prefill.engine import PrefillEngine, PrefillJob
from pdserve.server.prefill.lora import PrefillAdapter
from pdserve.server.prefill.push_budget import PushBudget
from pdserve.server.structured.constraint import Constraint
from pdserve.server.structured.grammars import request_constraint
from pdserve.server.structured.output_spec import SpecError
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc

log = logging.getLogger("pdserve.prefill")

WIRE_FORMATS = {dtype: KvLayout.scales_for(dtype) for dtype in NUMPY_DTYPES}
"""The KV dtypes this prefill worker can send, with the scale granularity each carries."""
WIRE_DTYPES = tuple(WIRE_FORMATS)
_TRANSPORT_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED)
"""A push failing with these says nothing about this prefill worker: the caller must not mark it dead."""


def ttft_due(request: pb.PrefillRequest, received: float) -> float | None:
    """When the request's first token is due on this worker's clock (time.monotonic() of `received`,
    when the call arrived): its arrival at the coordinator plus the TTFT budget it was admitted under;
    None without a budget (an older coordinator)."""
    if request.ttft_budget_seconds <= 0:
        return None
    return received - request.arrived_seconds_ago + request.ttft_budget_seconds


def _fail(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        if isinstance(error, asyncio.CancelledError):
            future.cancel()
        else:
            future.set_exception(error)


class PrefillService(worker_pb2_grpc.PrefillServicer, worker_pb2_grpc.ControlServicer):
    def __init__(self, engine: PrefillEngine, transport: KvTransport, model_config: ModelConfig, *,
                 fingerprint: str, address: str = "", budget: PushBudget | None = None,
                 hardware: Hardware | None = None):
        self.engine = engine
        self.hardware = hardware
        """The machine and what the worker's start-up chose on it (`hardware.py`), for its info."""
        self.transport = transport
        self.budget = budget or PushBudget(engine.config.max_pushes, engine.config.max_push_bytes)
        self.model_config = model_config
        self.fingerprint = pb.ModelFingerprint(digest=fingerprint, description=model_config.describe())
        self.address = address
        self.pushes: set[asyncio.Task] = set()
        self.kv_events: pb.KvEventsSource | None = None
        """Where its host prefix KV's events can be read (--kv-events-config), for the coordinator's index."""
        self.draining = False
        """SIGTERM: new Prefill calls are refused (UNAVAILABLE); running ones and their pushes finish."""
        self.active = 0
        """Prefill calls being served now."""

    async def _constraint(self, request: pb.PrefillRequest) -> Constraint | None:
        """The request's grammar, checked in a grammar child then compiled off the loop in bounded time, after
        the outputs so far (`Grammars.for_request`); SpecError or ValueError when it cannot be enforced."""
        grammars = self.engine.grammars
        if grammars is not None and request.sampling.structured.WhichOneof("kind"):
            await grammars.prepare(request.sampling.structured)
        return request_constraint(grammars, request, "prefill")

    def _check_target(self, layout: KvLayout) -> str | None:
        c = self.model_config
        ours = (c.num_layers, c.num_kv_heads, c.head_dim)
        theirs = (layout.num_layers, layout.num_kv_heads, layout.head_dim)
        if ours != theirs:
            return (f"decode worker's KV layout (layers, kv heads, head dim) = {theirs} does not fit this "
                    f"prefill worker's model {ours}: both tiers must serve the same checkpoint")
        windows = tuple(w or 0 for w in c.layer_windows)
        if layout.windows != windows:
            show = lambda ws: ",".join(map(str, ws)) or "none"  # noqa: E731
            return (f"decode worker's KV layout has layer windows {show(layout.windows)}, this prefill worker's "
                    f"model {show(windows)}: both tiers must serve the same checkpoint (and pdserve release)")
        kind = "heads" if c.mla is None else "mla_latent"
        if layout.kind != kind:
            return (f"decode worker's KV layout is of kind {layout.kind}, this prefill worker's model computes "
                    f"{kind}: both tiers must serve the same checkpoint (and pdserve release)")
        if layout.dtype not in WIRE_DTYPES:
            return (f"decode worker wants KV dtype {layout.dtype}; this prefill worker sends "
                    f"{', '.join(WIRE_DTYPES)}")
        return None

    def _check_format(self, target: pb.KvTarget) -> str | None:
        """Why the decode worker's KV format cannot meet what this worker sends, naming both sides; or None."""
        granularity = target.layout.scale_granularity or "none"
        if WIRE_FORMATS.get(target.layout.dtype) == granularity:
            return None
        sends = ", ".join(f"{d} (scales {g})" for d, g in WIRE_FORMATS.items())
        weights = getattr(getattr(self.engine, "config", None), "weight_dtype", "auto")
        return (f"KV formats cannot meet: decode worker {target.address or '?'} holds KV as dtype="
                f"{target.layout.dtype or '?'} scales={granularity}; this prefill worker (--weight-dtype "
                f"{weights}) sends {sends}")

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        received = time.monotonic()
        logs.request_id.set(request.request_id)  # every line logged for this request (and its push) names it
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "prefill worker is draining; pick another")
        mismatch = self._check_format(request.target)
        if mismatch:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, mismatch)
        try:
            layout = KvLayout.from_proto(request.target.layout)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"target KV layout: {e}")
        problem = self._check_target(layout)
        if problem:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        ids = list(request.token_ids)
        problem = self._request_problem(request)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        try:
            constraint = await self._constraint(request)
        except (SpecError, ValueError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        adapter = await self._adapter(request, context)
        nbytes = kv_bytes(layout, len(ids))
        too_big = self.budget.too_big(nbytes)
        if too_big:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, too_big)
        header = pb.KvHeader(
            request_id=request.request_id, attempt=request.attempt, transfer_token=request.transfer_token,
            fingerprint=self.fingerprint, layout=layout.to_proto(), num_tokens=len(ids),
            cached_blocks=request.target.cached_blocks,  # the decode worker's prefix-cache hits: not sent
            lora_name=request.lora.name,  # the decode worker refuses KV of another adapter than its request's
        )
        t0 = time.perf_counter()
        self.active += 1
        try:
            await self.budget.acquire(nbytes, len(ids))
            # the prompt's blocks the offload tiers hold after its cached prefix (those with prompt logprobs: none)
            key = None if adapter is None else adapter.key
            fetched = None if request.sampling.HasField("prompt_logprobs") else await self.engine.prefix.fetch(ids, key)
            job = self.engine.enqueue(ids, request.sampling, request.sample_index, layout.dtype, layout.block_size,
                                      due=ttft_due(request, received), constraint=constraint, fetched=fetched,
                                      adapter=adapter)
            opened = asyncio.get_running_loop().create_future()
            task = asyncio.create_task(self._push(request.target.address, header, layout, job, opened, nbytes))
            self.pushes.add(task)
            task.add_done_callback(self.pushes.discard)
            try:
                await opened  # the header was accepted: the decode worker's lease runs
                first_token = await job.first_token
            except BaseException:
                job.cancel()
                task.cancel()
                raise
        except grpc.aio.AioRpcError as e:  # the decode worker refused the header, or is unreachable
            code = e.code() if e.code() not in _TRANSPORT_CODES else grpc.StatusCode.ABORTED
            await context.abort(code, f"the KV push to decode worker {request.target.address} could not start: "
                                      f"{e.code().name}: {e.details()}")
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as e:  # the prefill itself failed
            log.exception("request %s: prefill failed", request.request_id)
            await context.abort(grpc.StatusCode.INTERNAL, f"prefill failed: {e!r}")
        finally:
            self.active -= 1
        seconds = time.perf_counter() - t0
        metrics.prompt_tokens.inc(len(ids))
        response = pb.PrefillResponse(first_token_id=first_token, prefill_seconds=seconds,
                                      prompt_logprobs=job.prompt_logprobs)
        if job.first_logprob is not None:
            response.first_token_logprob.CopyFrom(job.first_logprob)
        return response

    async def _adapter(self, request: pb.PrefillRequest, context) -> PrefillAdapter | None:
        """The request's LoRA adapter packed on the host (loaded off the event loop on a miss); None for the base
        model. Aborts the call when this worker serves no adapters or the adapter cannot be loaded."""
        if not request.HasField("lora"):
            return None
        lora = request.lora
        if self.engine.lora is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"LoRA adapter {lora.name!r}: this prefill worker serves no LoRA adapters; start it "
                                f"with --enable-lora")
        if not lora.name or not lora.path:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "lora.name and lora.path must both be set")
        try:
            return await asyncio.to_thread(self.engine.lora.adapter, AdapterKey(lora.id, lora.name, lora.path))
        except LoraLoadError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def _request_problem(self, request: pb.PrefillRequest) -> str | None:
        """What is wrong with a PrefillRequest, whoever sent it (INVALID_ARGUMENT), or None."""
        c = self.model_config
        return (request_checks.identity_problem(request.request_id, request.transfer_token)
                or request_checks.ids_problem("token_ids", request.token_ids, c.vocab_size)
                or request_checks.length_problem("token_ids", len(request.token_ids), 0, self.engine.max_model_len)
                or (f"target.cached_blocks {request.target.cached_blocks} exceeds the {len(request.token_ids)}-token "
                    f"prompt's blocks" if request.target.cached_blocks * request.target.layout.block_size
                    > len(request.token_ids) else None)
                or request_checks.sampling_problem(request.sampling, c.vocab_size)
                or _budget_problem(request)
                or (None if request.target.address else "target.address must be set"))

    def busy(self) -> bool:
        return bool(self.active or self.pushes or self.engine.queued_tokens)

    async def _push(self, address: str, header: pb.KvHeader, layout: KvLayout, job: PrefillJob,
                    opened: asyncio.Future, nbytes: int) -> None:
        """Streams the job's KV groups as they come; holds `nbytes` of the budget until it ends."""
        sender: KvSender | None = None
        try:
            await job.started
            sender = await self.transport.open(address, header, layout)
            opened.set_result(None)
            t0 = time.perf_counter()
            while (group := await job.kv.get()) is not None:
                if isinstance(group, BaseException):
                    metrics.kv_transfer_failures.inc()
                    await sender.abort(f"prefill failed: {group!r}")
                    return
                await sender.send(group)
            reply = await sender.finish(await job.first_token)
            metrics.kv_transfer_bytes.inc(reply.bytes_received)
            metrics.kv_transfer_seconds.observe(time.perf_counter() - t0)
        except grpc.aio.AioRpcError as e:
            metrics.kv_transfer_failures.inc()
            log.warning("request %s: KV push to %s refused: %s %s", header.request_id, address,
                        e.code().name, e.details())
            _fail(opened, e)
        except asyncio.CancelledError:
            if sender is not None:
                sender.cancel()
            _fail(opened, asyncio.CancelledError())
            raise
        except Exception as e:
            metrics.kv_transfer_failures.inc()
            log.exception("request %s: KV push to %s failed", header.request_id, address)
            if sender is not None:
                await sender.abort(f"the prefill worker failed sending: {e!r}")
            _fail(opened, e)
        finally:
            await self.budget.release(nbytes)

    async def GetInfo(self, request: pb.GetInfoRequest, context) -> pb.WorkerInfo:
        return self.info()

    def info(self) -> pb.WorkerInfo:
        return pb.WorkerInfo(
            role="prefill",
            address=self.address,
            fingerprint=self.fingerprint,
            load=pb.WorkerLoad(queued_prefill_tokens=self.engine.queued_tokens + self.budget.waiting_tokens,
                               running_requests=len(self.pushes), prefill_buckets=self.engine.load()),
            max_model_len=self.engine.max_model_len,
            draining=self.draining,
            prefill_order=self.engine.scheduler.order,
            prefill_deadlines=True,
            hardware=self.hardware.to_proto() if self.hardware is not None else None,
            kv_events=self.kv_events,
        )


def _budget_problem(request: pb.PrefillRequest) -> str | None:
    budget, ago = request.ttft_budget_seconds, request.arrived_seconds_ago
    if not (math.isfinite(budget) and budget >= 0 and math.isfinite(ago) and ago >= 0):
        return (f"ttft_budget_seconds ({budget}) and arrived_seconds_ago ({ago}) must be finite and >= 0 "
                f"(0 and 0: no TTFT budget)")
    return None
