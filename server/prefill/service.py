"""The prefill worker's gRPC face: Prefill returns the first token, then pushes the KV."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from pdserve.kvcache.layout import KvLayout
from pdserve.kvcache.sender import KvSender
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc
from pdserve.server import logs, metrics, request_checks
from pdserve.server.model.config import ModelConfig
from pdserve.server.prefill.engine import PrefillEngine

log = logging.getLogger("pdserve.prefill")

WIRE_FORMATS = {"float32": "none", "bfloat16": "none", "float16": "none", "fp8_e4m3": "block_head",
                "int8": "block_head"}
"""The KV dtypes this prefill worker can send, with the scale granularity each carries."""
WIRE_DTYPES = tuple(WIRE_FORMATS)


class PrefillService(worker_pb2_grpc.PrefillServicer, worker_pb2_grpc.ControlServicer):
    def __init__(self, engine: PrefillEngine, sender: KvSender, model_config: ModelConfig, *,
                 fingerprint: str, address: str = ""):
        self.engine = engine
        self.sender = sender
        self.model_config = model_config
        self.fingerprint = pb.ModelFingerprint(digest=fingerprint, description=model_config.describe())
        self.address = address
        self.pushes: set[asyncio.Task] = set()
        self.draining = False
        """SIGTERM: new Prefill calls are refused (UNAVAILABLE); running ones and their pushes finish."""
        self.active = 0
        """Prefill calls being served now."""

    def _check_target(self, layout: KvLayout) -> str | None:
        c = self.model_config
        ours = (c.num_layers, c.num_kv_heads, c.head_dim)
        theirs = (layout.num_layers, layout.num_kv_heads, layout.head_dim)
        if ours != theirs:
            return (f"decode worker's KV layout (layers, kv heads, head dim) = {theirs} does not fit this "
                    f"prefill worker's model {ours}: both tiers must serve the same checkpoint")
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
        t0 = time.perf_counter()
        self.active += 1
        try:
            result = await self.engine.submit(ids, request.sampling, request.sample_index, layout.dtype,
                                              layout.block_size)
        finally:
            self.active -= 1
        seconds = time.perf_counter() - t0
        metrics.prompt_tokens.inc(len(ids))
        header = pb.KvHeader(
            request_id=request.request_id, attempt=request.attempt, transfer_token=request.transfer_token,
            fingerprint=self.fingerprint, layout=layout.to_proto(), num_tokens=len(ids),
            cached_blocks=request.target.cached_blocks,  # the decode worker's prefix-cache hits: not sent
        )
        task = asyncio.create_task(self._push(request.target.address, header, layout, result))
        self.pushes.add(task)
        task.add_done_callback(self.pushes.discard)
        return pb.PrefillResponse(first_token_id=result.first_token, prefill_seconds=seconds)

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
                or (None if request.target.address else "target.address must be set"))

    def busy(self) -> bool:
        return bool(self.active or self.pushes or self.engine.queued_tokens)

    async def _push(self, address: str, header: pb.KvHeader, layout: KvLayout, result) -> None:
        try:
            t0 = time.perf_counter()
            reply = await self.sender.send(address, header, layout, result.k, result.v, result.first_token,
                                           k_scales=result.k_scales, v_scales=result.v_scales)
            metrics.kv_transfer_bytes.inc(reply.bytes_received)
            metrics.kv_transfer_seconds.observe(time.perf_counter() - t0)
        except grpc.aio.AioRpcError as e:
            log.warning("request %s: KV push to %s refused: %s %s", header.request_id, address,
                        e.code().name, e.details())
        except Exception:
            log.exception("request %s: KV push to %s failed", header.request_id, address)

    async def GetInfo(self, request: pb.GetInfoRequest, context) -> pb.WorkerInfo:
        return self.info()

    def info(self) -> pb.WorkerInfo:
        return pb.WorkerInfo(
            role="prefill",
            address=self.address,
            fingerprint=self.fingerprint,
            load=pb.WorkerLoad(queued_prefill_tokens=self.engine.queued_tokens, running_requests=len(self.pushes)),
            max_model_len=self.engine.max_model_len,
            draining=self.draining,
        )
