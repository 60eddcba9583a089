"""Where an admitted request's first token comes from: its prompt's KV sent by a prefill worker (`KvArrival`),
or its prompt computed on this worker (`LocalPrefill`): when no prefill worker is alive, or when this worker
holds all but a short suffix of it (conditional disaggregation, `local_prefill_rule.py`).

Life cycle: built once the sequence holds its blocks, before the call answers `reserved` (a `KvArrival` expects
the transfer at once, so the prefill worker's chunks are taken from then on); then `first_token` waits for it,
or aborts the call with the status that says what went wrong.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from pdserve.kvcache.receiver import KvReceiver
from pdserve.v1 import worker_pb2 as pb
from pdserve.server import metrics
from pdserve.server.decode.engine_api import Engine
from pdserve.server.decode.sequence import Sequence
from pdserve.server.decode.windows import stale_blocks

log = logging.getLogger("pdserve.decode")


class KvArrival:
    def __init__(self, receiver: KvReceiver, seq: Sequence, request: pb.DecodeRequest, vocab_size: int):
        self.receiver = receiver
        self.seq = seq
        self.lease = request.lease_seconds or 30.0
        self.vocab_size = vocab_size
        self.transfer = receiver.expect(seq.request_id, request.attempt, request.transfer_token, len(seq.prompt_ids),
                                        cached_blocks=seq.num_hit_blocks,
                                        lora_name="" if seq.lora is None else seq.lora.key.name)

    async def first_token(self, context: grpc.aio.ServicerContext) -> tuple[int, None]:
        """The prefill worker's first token, once the prompt's KV is in its blocks (the stale blocks of a windowed
        model noted); DEADLINE_EXCEEDED when the KV stalls for the lease, ABORTED when the transfer fails."""
        rid, lease = self.seq.request_id, self.lease
        try:  # the lease runs from the prefill worker's header, restarting with every chunk
            first_token = await self.transfer.wait(lease)
        except TimeoutError:
            metrics.kv_transfer_failures.inc()
            log.warning("request %s: KV stalled for the %.1f s lease; blocks freed", rid, lease)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"KV for {rid} did not arrive within {lease:.1f} s")
        except Exception as e:  # the transfer failed: say why
            if isinstance(e, asyncio.CancelledError):
                raise
            metrics.kv_transfer_failures.inc()
            await context.abort(grpc.StatusCode.ABORTED, f"KV transfer for {rid} failed: {e}")
        if not 0 <= first_token < self.vocab_size:
            await context.abort(grpc.StatusCode.ABORTED,
                                f"KV transfer for {rid} failed: KvEnd.first_token_id {first_token} lies "
                                f"outside the vocabulary [0, {self.vocab_size})")
        self.seq.num_stale_blocks = stale_blocks(self.receiver.layout, len(self.seq.prompt_ids))
        metrics.kv_transfer_bytes.inc(self.transfer.bytes_received)
        metrics.kv_transfer_seconds.observe(self.transfer.seconds)
        return first_token, None


class LocalPrefill:
    def __init__(self, engine: Engine, seq: Sequence, fallback: bool = True):
        """fallback: the request asked for it (no prefill worker alive), rather than the worker choosing it
        (conditional disaggregation: `local_prefill_rule.py`)."""
        self.engine = engine
        self.seq = seq
        self.fallback = fallback

    async def first_token(self, context: grpc.aio.ServicerContext) -> tuple[int, pb.TokenEvent]:
        """The first token this worker computes, and the event that sends it (with its logprob and the prompt's
        when asked); INTERNAL when the prefill fails."""
        seq = self.seq
        try:
            first_token = await self.engine.prefill_locally(seq)
        except Exception as e:
            log.exception("request %s: local prefill failed", seq.request_id)
            await context.abort(grpc.StatusCode.INTERNAL, f"local prefill of {seq.request_id} failed: {e!r}")
        if self.fallback:
            metrics.local_prefill_fallbacks.inc()
        event = pb.TokenEvent(token_ids=[first_token], logprobs=seq.logprobs[:1], prompt_logprobs=seq.prompt_logprobs)
        del seq.logprobs[:1]  # the first token's (vLLM may have sampled more already)
        return first_token, event
