"""The decode worker's gRPC face: Decode (stream), Abort, KV push, worker info."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
import torch

from pdserve.kvcache.block_pool import OutOfBlocks
from pdserve.kvcache.receiver import KvReceiver
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb
from pdserve.v1 import worker_pb2_grpc
from pdserve.server import logs, metrics, request_checks
from pdserve.server.decode.engine import DecodeEngine
from pdserve.server.decode.sampler import sample
from pdserve.server.decode.sequence import Sequence

log = logging.getLogger("pdserve.decode")

RETRY_AFTER_MS = "250"


class DecodeService(worker_pb2_grpc.DecodeServicer, worker_pb2_grpc.ControlServicer):
    def __init__(self, engine: DecodeEngine, receiver: KvReceiver, *, fingerprint: str, description: str,
                 eos_ids: frozenset[int], max_model_len: int, address: str = "", kv_address: str = ""):
        self.engine = engine
        self.receiver = receiver
        self.fingerprint = fingerprint
        self.description = description
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.address = address
        self.kv_address = kv_address
        self.draining = False
        """SIGTERM: new Decode calls are refused (UNAVAILABLE), in-flight ones finish."""
        self.vocab_size = engine.model.config.vocab_size

    def _request_problem(self, request: pb.DecodeRequest) -> str | None:
        """What is wrong with a DecodeRequest, whoever sent it (INVALID_ARGUMENT), or None."""
        remaining = request.sampling.max_tokens - request.num_output_tokens
        return (request_checks.identity_problem(request.request_id, request.transfer_token)
                or request_checks.ids_problem("prompt_token_ids", request.prompt_token_ids, self.vocab_size)
                or request_checks.sampling_problem(request.sampling, self.vocab_size)
                or (f"num_output_tokens {request.num_output_tokens} must be below sampling.max_tokens "
                    f"{request.sampling.max_tokens}" if remaining <= 0 else None)
                or request_checks.length_problem("prompt_token_ids", len(request.prompt_token_ids), remaining,
                                                 self.max_model_len)
                or request_checks.lease_problem(request.lease_seconds))

    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.DecodeResponse]:
        engine = self.engine
        rid = request.request_id
        logs.request_id.set(rid)  # every line logged for this request names it
        prompt = list(request.prompt_token_ids)
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker is draining; pick another")
        if rid in engine.sequences:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {rid} is already decoding here")
        problem = self._request_problem(request)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        if len(engine.sequences) >= engine.max_running:
            await context.send_initial_metadata((("retry-after-ms", RETRY_AFTER_MS),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"decode worker runs its maximum of {engine.max_running} requests; you may retry")
        remaining = request.sampling.max_tokens - request.num_output_tokens
        need = engine.blocks_needed(len(prompt), remaining, self.max_model_len)
        try:
            blocks = engine.pool.allocate(need)
        except OutOfBlocks as e:
            await context.send_initial_metadata((("retry-after-ms", RETRY_AFTER_MS),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"KV cache full: {e}; you may retry")
        seq = Sequence(
            request_id=rid, prompt_ids=prompt, sampling=request.sampling, block_table=blocks,
            eos_ids=self.eos_ids, max_model_len=self.max_model_len,
            num_prior_outputs=request.num_output_tokens,
        )
        engine.reserve(seq)
        try:
            if request.local_prefill:  # no prefill worker is alive: run the prompt here
                yield pb.DecodeResponse(reserved=pb.Reserved(num_blocks=len(blocks)))
                local = asyncio.ensure_future(asyncio.to_thread(self._prefill_locally, seq))
                try:
                    first_token = await asyncio.shield(local)
                except asyncio.CancelledError:
                    with contextlib.suppress(Exception):  # it writes into our blocks: free them after it
                        await local
                    raise
                except Exception as e:
                    log.exception("request %s: local prefill failed", rid)
                    await context.abort(grpc.StatusCode.INTERNAL, f"local prefill of {rid} failed: {e!r}")
                metrics.local_prefill_fallbacks.inc()
                yield pb.DecodeResponse(tokens=pb.TokenEvent(token_ids=[first_token]))
            else:
                transfer = self.receiver.expect(rid, request.attempt, request.transfer_token, len(prompt))
                yield pb.DecodeResponse(reserved=pb.Reserved(num_blocks=len(blocks)))
                lease = request.lease_seconds or 30.0
                try:  # the lease runs from the prefill worker's header, restarting with every chunk
                    first_token = await transfer.wait(lease)
                except TimeoutError:
                    log.warning("request %s: KV stalled for the %.1f s lease; blocks freed", rid, lease)
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"KV for {rid} did not arrive within {lease:.1f} s")
                except Exception as e:  # the transfer failed: say why
                    if isinstance(e, asyncio.CancelledError):
                        raise
                    await context.abort(grpc.StatusCode.ABORTED, f"KV transfer for {rid} failed: {e}")
                if not 0 <= first_token < self.vocab_size:
                    await context.abort(grpc.StatusCode.ABORTED,
                                        f"KV transfer for {rid} failed: KvEnd.first_token_id {first_token} lies "
                                        f"outside the vocabulary [0, {self.vocab_size})")
                metrics.kv_transfer_bytes.inc(transfer.bytes_received)
                metrics.kv_transfer_seconds.observe(transfer.seconds)
            engine.start(seq, first_token)
            while True:
                ids = await seq.events.get()
                if ids is None:
                    break
                yield pb.DecodeResponse(tokens=pb.TokenEvent(token_ids=ids))
            message = "decode step failed" if seq.finish_reason == gen_pb.FINISH_REASON_ERROR else ""
            yield pb.DecodeResponse(finished=pb.Finished(reason=seq.finish_reason, message=message))
        finally:
            engine.abort(rid, gen_pb.FINISH_REASON_ABORT)
            self.receiver.cancel(rid)
            await self.receiver.settle(rid)  # a piece being written in its thread lands before the free
            engine.release(seq)

    def _prefill_locally(self, seq: Sequence) -> int:
        """The prompt's KV into the sequence's blocks with the torch model; the first token (a worker thread)."""
        engine = self.engine
        logits = engine.model.prefill(torch.tensor(seq.prompt_ids, dtype=torch.int64), seq.block_table,
                                      engine.cache)  # [S, V]
        p = seq.sampling
        token = sample(
            logits[-1:],
            torch.tensor([p.temperature], dtype=torch.float32),
            torch.tensor([p.top_k], dtype=torch.int64),
            torch.tensor([p.top_p], dtype=torch.float32),
            [p.seed if p.HasField("seed") else None],
            [seq.sample_index],
        )
        return int(token[0])

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        return pb.AbortResponse(found=self.engine.abort(request.request_id, gen_pb.FINISH_REASON_ABORT))

    async def GetInfo(self, request: pb.GetInfoRequest, context) -> pb.WorkerInfo:
        return self.info()

    def info(self) -> pb.WorkerInfo:
        engine = self.engine
        running = len(engine.running)
        return pb.WorkerInfo(
            role="decode",
            address=self.address,
            fingerprint=pb.ModelFingerprint(digest=self.fingerprint, description=self.description),
            kv_layout=engine.layout.to_proto(),
            load=pb.WorkerLoad(
                running_requests=running,
                waiting_requests=len(engine.sequences) - running,
                free_kv_blocks=engine.pool.num_free,
                total_kv_blocks=engine.pool.num_total,
                max_running_requests=engine.max_running,
            ),
            max_model_len=self.max_model_len,
            draining=self.draining,
            kv_address=self.kv_address,
        )
