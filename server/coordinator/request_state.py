"""One client request across its attempts: what went out to the client, and what each retry or
migration starts from."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from pdserve.v1 import generation_pb2
from pdserve.server.coordinator.admission import Deadline, RequestFailed
from pdserve.server.coordinator.shared_prompt import SharedPrompt
from pdserve.server.coordinator.validate import ValidRequest


@dataclass
class RequestState:
    """One client request across its attempts."""

    req: ValidRequest
    deadline: Deadline
    worker_request_id: str
    outputs: list[int] = field(default_factory=list)
    """Every token id sent on to the client so far (a migration continues after them)."""
    attempt: int = 0
    retries: int = 0
    migrations: int = 0
    last_failure: str = ""
    """Why the previous attempt was lost."""
    prompt_logprobs: list[generation_pb2.TokenLogprob] | None = None
    """From the prefill (when asked for); None until it answered, [] once sent on."""
    shared: SharedPrompt | None = None
    """A choice of a request with n > 1: how the choices share the prompt's KV."""
    choice: int = 0
    """Which choice this is (0 leads: it places the prompt's KV; the others follow it)."""
    scheduled_at: float | None = None
    """time.monotonic() when the first attempt left the queue with its workers picked (vLLM's scheduled)."""

    @property
    def leads(self) -> bool:
        return self.shared is not None and self.choice == 0

    @property
    def sampling(self) -> generation_pb2.SamplingParams:
        """What the workers get: the prompt's logprobs only until they have arrived."""
        s = self.req.sampling
        if self.prompt_logprobs is None or not s.HasField("prompt_logprobs"):
            return s
        without = generation_pb2.SamplingParams()
        without.CopyFrom(s)
        without.ClearField("prompt_logprobs")
        return without

    def take_prompt_logprobs(self) -> list[generation_pb2.TokenLogprob]:
        """The prompt's logprobs for the next message to the client: once."""
        out = self.prompt_logprobs or []
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = []
        return out

    @property
    def worker_id(self) -> str:
        return self.worker_request_id if self.attempt == 0 else f"{self.worker_request_id}.a{self.attempt}"

    def no_worker_left(self, role: str) -> RequestFailed:
        if self.last_failure:
            return RequestFailed(grpc.StatusCode.UNAVAILABLE, f"{self.last_failure}; no ready {role} worker to continue on")
        return RequestFailed(grpc.StatusCode.UNAVAILABLE, f"no ready {role} worker")
