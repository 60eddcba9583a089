"""Targets the harness drives: pdserve's gRPC `Generate` and any OpenAI-compatible HTTP server.

Each `send` streams one request and records, on one clock (time.perf_counter), when it was sent and
when each chunk holding new tokens arrived: all latency metrics derive from those stamps.
"""

from __future__ import annotations

import abc
import json
import time

from pdserve.server.client import build_request, stream
from pdserve.server.plan.datasets import BenchRequest
from pdserve.server.plan.run_summary import RequestOutput


class Target(abc.ABC):
    name = "target"

    @abc.abstractmethod
    async def send(self, request: BenchRequest, out: RequestOutput) -> None:
        """Sends one request and records its chunk times and token counts into `out`."""

    async def close(self) -> None:
        pass


class GrpcTarget(Target):
    """pdserve's public `Generation/Generate` stream."""

    name = "pdserve-grpc"

    def __init__(self, address: str, timeout: float | None = None):
        import grpc
        from pdserve.v1 import generation_pb2_grpc

        from pdserve.server.serving import CHANNEL_OPTIONS

        self.address, self.timeout = address, timeout
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = generation_pb2_grpc.GenerationStub(self._channel)

    async def send(self, request: BenchRequest, out: RequestOutput) -> None:
        import grpc

        from pdserve.server.client import build_request
        from pdserve.server.finish import FINISH_NAMES

        req = build_request(
            prompt=request.prompt_text,
            max_tokens=request.output_len,
            temperature=0.0,
            ignore_eos=True,
            token_ids=list(request.prompt_ids) if request.prompt_ids is not None else None,
        )
        out.sent = time.perf_counter()
        try:
            async for msg in self._stub.Generate(req, timeout=self.timeout):
                now = time.perf_counter()
                if msg.token_ids:
                    out.chunk_times.append(now)
                    out.chunk_tokens.append(len(msg.token_ids))
                if msg.finish_reason:
                    out.finish_reason = FINISH_NAMES.get(msg.finish_reason, str(msg.finish_reason))
                    out.output_len = msg.usage.completion_tokens
                    out.prompt_len = msg.usage.prompt_tokens or out.prompt_len
            out.success = bool(out.chunk_times) and out.finish_reason in ("stop", "length")
            if not out.success:
                out.error = f"stream ended with finish_reason={out.finish_reason or 'none'}"
        except grpc.aio.AioRpcError as e:
            out.error = f"{e.code().name}: {e.details()}"
        out.done = time.perf_counter()

    async def close(self) -> None:
        await self._channel.close()


class OpenAITarget(Target):
    """`POST /v1/completions` with `stream: true` on any OpenAI-compatible server (vLLM, pdserve's HTTP front).

    Token-id prompts are sent as a list of ints; greedy (temperature 0) with ignore_eos, so every server
    generates exactly `output_len` tokens.
    """

    name = "openai-http"

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        api_key: str | None = None,
        timeout: float | None = None,
    ):
        import httpx

        self.base_url, self.model = base_url.rstrip("/"), model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            limits=limits,
            timeout=httpx.Timeout(timeout, connect=30.0),
        )

    async def _model(self) -> str:
        if self.model is None:
            resp = await self._client.get("/v1/models")
            resp.raise_for_status()
            self.model = resp.json()["data"][0]["id"]
        return self.model

    async def send(self, request: BenchRequest, out: RequestOutput) -> None:
        import httpx

        body = {
            "model": await self._model(),
            "prompt": list(request.prompt_ids) if request.prompt_ids is not None else request.prompt_text,
            "max_tokens": request.output_len,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        out.sent = time.perf_counter()
        try:
            async with self._client.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    out.error = (
                        f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                    )
                    out.done = time.perf_counter()
                    return
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    now = time.perf_counter()
                    chunk = json.loads(data)
                    if "error" in chunk:
                        out.error = str(chunk["error"])[:300]
                        break
                    for choice in chunk.get("choices") or []:
                        if choice.get("text"):
                            out.chunk_times.append(now)
                            out.chunk_tokens.append(1)  # refined below from usage
                        if choice.get("finish_reason"):
                            out.finish_reason = choice["finish_reason"]
                    if chunk.get("usage"):
                        out.output_len = chunk["usage"].get("completion_tokens", 0)
                        out.prompt_len = chunk["usage"].get("prompt_tokens") or out.prompt_len
            if not out.output_len:
                out.output_len = sum(out.chunk_tokens)
            out.success = bool(out.chunk_times) and not out.error
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            out.error = f"{type(e).__name__}: {e}"
        out.done = time.perf_counter()

    async def close(self) -> None:
        await self._client.aclose()


def greedy_ttft(addr: str, prompt: list[int], max_tokens: int) -> tuple[float | None, list[int]]:
    """Seconds to the first token and the greedy answer of one gRPC request for `prompt`'s token ids."""
    t0 = time.perf_counter()
    first, tokens = None, []
    for msg in stream(addr, build_request(token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                      timeout=300):
        if first is None and msg.token_ids:
            first = time.perf_counter() - t0
        tokens.extend(msg.token_ids)
    return first, tokens
