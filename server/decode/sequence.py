"""One request on the decode worker: its blocks, its tokens so far, where its output goes."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import grpc

from pdserve.kvcache.adapter_key import AdapterKey
from pdserve.kvcache.tail_cache import Tail
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb
from pdserve.server.decode.local_prefill_rule import LocalPrefillRule
from pdserve.server.finish import blocked_ids, finish_reason
from pdserve.server.structured.constraint import Constraint
from pdserve.server.structured.output_spec import one_line

if TYPE_CHECKING:
    from pdserve.server.decode.lora import LoraAdapter


class TokenSink(Protocol):
    """Where an engine puts one sequence's output, in order: lists of new token ids (their logprobs wait
    on `seq.logprobs`), then None once it has finished (`seq.finish_reason` says why). An asyncio.Queue
    is one."""

    def put_nowait(self, ids: list[int] | None, /) -> None: ...


class SeqState(enum.Enum):
    WAITING = "waiting"
    """Queued for blocks: new, or preempted (its blocks freed, its tokens kept)."""
    WAITING_KV = "waiting_kv"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    sampling: gen_pb.SamplingParams
    eos_ids: frozenset[int]
    max_model_len: int
    block_table: list[int] = field(default_factory=list)
    num_prior_outputs: int = 0
    """Outputs produced before this worker took the request (the tail of prompt_ids)."""
    output_ids: list[int] = field(default_factory=list)
    state: SeqState = SeqState.WAITING
    num_cached_tokens: int = 0
    """Leading tokens whose KV already sits in block_table (prefix-cache hits, or all KV written so far)."""
    num_hit_blocks: int = 0
    """Leading blocks reused from the prefix cache when the sequence was admitted (those loaded from the offload
    tiers included)."""
    offload_loads: list[tuple[int, bytes]] = field(default_factory=list)
    """Admitted, its blocks (block id, hash) to load from the offload tiers before it is announced admitted."""
    tail_copy: tuple[Tail, int] | None = None
    """Admitted after a kept tail (`kvcache/tail_cache.py`): the tail, its block held by this sequence, whose KV the
    engine copies into the block id given before the sequence computes past it (`Scheduler.tail_copied`)."""
    offload_tail: tuple[int, Tail] | None = None
    """Admitted after a tail the offload tiers hold (`kv_offload.py`): the block id its KV is loaded into, after the
    `offload_loads`; a load that fails makes its tokens uncached (computed)."""
    num_stale_blocks: int = 0
    """Leading blocks whose windowed layers' KV never arrived (the prefill tier sends no KV behind a sliding
    window; `KvLayout.stale_tokens`): no other sequence may reuse them from the prefix cache."""
    num_dropped_blocks: int = 0
    """Leading entries of block_table behind every layer's sliding window (`KvLayout.blocks_behind_windows`):
    their blocks went back to the pool (or were never taken) and the scheduler's null block stands in them,
    which no layer reads. 0 for a model with a full-attention layer."""
    local_prefill: bool = False
    """Its prompt's KV is computed on this worker (`DecodeRequest.local_prefill`, or chosen at admission by
    `local_prefill_rule`): one forward writes every prompt position past its cached blocks, so it takes a block for
    each, those behind the windows dropped after."""
    local_prefill_rule: LocalPrefillRule | None = None
    """Conditional disaggregation: the scheduler sets local_prefill at admission when this rule takes the prompt
    (`local_prefill_rule.py`); None: the request decided (local_prefill)."""
    block_hashes: list[bytes] = field(default_factory=list)
    """The chained hashes of its leading full blocks, as far as the scheduler needed them (its tokens so far
    never change)."""
    resume_from: int | None = None
    """Preempted and readmitted: tokens [resume_from, num_tokens - 1) must be prefilled again."""
    admitted: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    """Resolves when the sequence holds its blocks (first admission only)."""
    finish_reason: int = gen_pb.FINISH_REASON_UNSPECIFIED
    error: tuple[int, str] | None = None
    """With FINISH_REASON_ERROR: (gRPC status code, message) when the request's own input ended it (its
    grammar hit a parser limit); None: a server fault ("decode step failed", INTERNAL)."""
    events: TokenSink = field(default_factory=asyncio.Queue)
    """Where its output goes (the engine's `add` is given it): new token ids, then None when finished."""
    logprobs: list[gen_pb.TokenLogprob] = field(default_factory=list)
    """For the ids in `events` not yet sent, in order, when sampling.logprobs is set."""
    prompt_logprobs: list[gen_pb.TokenLogprob] = field(default_factory=list)
    """A local prefill's prompt logprobs when sampling.prompt_logprobs is set (one per token after the first)."""
    constraint: Constraint | None = None
    """sampling.structured's matcher, advanced by every output (those before a migration replayed into it)."""
    draft_len: int = 0
    """draft_model speculation: leading tokens whose draft-model KV is in the draft's cache, at the same block
    ids (`spec/draft.py`); back to 0 when the blocks go."""
    lora: LoraAdapter | None = None
    """The LoRA adapter it decodes with (`DecodeRequest.lora`, packed by `lora.LoraSlots`); None: the base model.
    Its key enters every block hash of the sequence (KV belongs to its adapter)."""

    @property
    def adapter_key(self) -> AdapterKey | None:
        return None if self.lora is None else self.lora.key

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def sample_index(self) -> int:
        """Which output token (counted from the request's start) is sampled next."""
        return self.num_prior_outputs + len(self.output_ids)

    def prompt_and_outputs(self) -> tuple[list[int], list[int]]:
        """The request's prompt and every output so far (those before a migration included)."""
        cut = len(self.prompt_ids) - self.num_prior_outputs
        return self.prompt_ids[:cut], self.prompt_ids[cut:] + self.output_ids

    def blocked_ids(self) -> list[int]:
        """Ids the next token may not be while fewer than min_tokens are out: the stop ids and, unless
        ignore_eos, EOS (vLLM's min_tokens)."""
        return blocked_ids(self.sampling, self.eos_ids, self.sample_index)

    def check_stop(self, token: int) -> int:
        """The finish reason after appending `token`, or UNSPECIFIED to go on (server/finish.py)."""
        return finish_reason(token, self.sample_index, self.num_tokens, self.sampling, self.eos_ids,
                             self.max_model_len)

    def append(self, token: int) -> None:
        """Takes an output; the stop rule, then the grammar (complete: stop; refusing it: error), may end it."""
        self.output_ids.append(token)
        reason = self.check_stop(token)
        if self.constraint is not None and reason != gen_pb.FINISH_REASON_STOP:
            if not self.constraint.advance(token):
                reason = gen_pb.FINISH_REASON_ERROR
                self.error = grammar_failure(self.constraint, self.sample_index - 1)
            elif self.constraint.done:
                reason = gen_pb.FINISH_REASON_STOP
        if reason != gen_pb.FINISH_REASON_UNSPECIFIED:
            self.finish(reason)

    def finished_event(self) -> pb.Finished:
        """The `finished` event this sequence ends with (its error's status and message, when it failed)."""
        if self.finish_reason != gen_pb.FINISH_REASON_ERROR:
            return pb.Finished(reason=self.finish_reason)
        status, message = self.error or (grpc.StatusCode.INTERNAL.value[0], "decode step failed")
        return pb.Finished(reason=self.finish_reason, message=message, status=status)

    def finish(self, reason: int) -> None:
        if self.state is not SeqState.FINISHED:
            self.state = SeqState.FINISHED
            self.finish_reason = reason


def admissible(request, sequences: dict, max_model_len: int) -> tuple[str, list[int]]:
    """(request id, prompt) of a DecodeRequest either engine may take; ValueError (bad or too long) if not."""
    rid, prompt = request.request_id, list(request.prompt_token_ids)
    if rid in sequences:
        raise ValueError(f"request {rid} is already decoding here")
    if not prompt or request.sampling.max_tokens <= 0:
        raise ValueError("prompt_token_ids and sampling.max_tokens must be set")
    if len(prompt) >= max_model_len:
        raise ValueError(f"a prompt of {len(prompt)} tokens leaves no room to generate within "
                         f"max_model_len {max_model_len}")
    return rid, prompt


def grammar_failure(constraint: Constraint, index: int) -> tuple[int, str] | None:
    """Why a grammar refused output token `index` (a masked draw never picks a refused token): the request's
    fault when the grammar outgrew a parser limit (INVALID_ARGUMENT, naming the field), else None (a fault of
    the server's)."""
    if not constraint.hit_limit:
        return None
    return (grpc.StatusCode.INVALID_ARGUMENT.value[0],
            f"sampling.structured: grammar too complex: at output token {index} it exceeds a parser limit "
            f"({one_line(constraint.error.split('<state>')[0])})")
