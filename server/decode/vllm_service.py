"""The decode worker's gRPC face over the vLLM engine: the native service, but vLLM runs a local prefill."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from pdserve.server import logs, metrics
from pdserve.server.decode.sequence import Sequence
from pdserve.server.decode.service import DecodeService
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb


class VllmDecodeService(DecodeService):
    async def Decode(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.DecodeResponse]:
        if not request.local_prefill:
            async for response in super().Decode(request, context):
                yield response
            return
        # No prefill worker is alive: vLLM runs the prompt itself and streams the first token like the rest.
        engine, rid = self.engine, request.request_id
        logs.request_id.set(rid)
        prompt = list(request.prompt_token_ids)
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker is draining; pick another")
        if rid in engine.sequences:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {rid} is already decoding here")
        problem = self._request_problem(request)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        seq = Sequence(
            request_id=rid, prompt_ids=prompt, sampling=request.sampling, block_table=[],
            eos_ids=self.eos_ids, max_model_len=self.max_model_len, num_prior_outputs=request.num_output_tokens,
        )
        engine.reserve(seq)
        try:
            yield pb.DecodeResponse(reserved=pb.Reserved(num_blocks=0))
            metrics.local_prefill_fallbacks.inc()
            engine.start(seq, None)
            while (ids := await seq.events.get()) is not None:
                yield pb.DecodeResponse(tokens=pb.TokenEvent(token_ids=ids))
            message = "vLLM step failed" if seq.finish_reason == gen_pb.FINISH_REASON_ERROR else ""
            yield pb.DecodeResponse(finished=pb.Finished(reason=seq.finish_reason, message=message))
        finally:
            engine.abort(rid, gen_pb.FINISH_REASON_ABORT)
            engine.release(seq)
