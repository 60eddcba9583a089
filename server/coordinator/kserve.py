"""KServe v2 / Open Inference Protocol gRPC (`inference.GRPCInferenceService`) on the coordinator.

The wire comes from the stubs `tritonclient` ships. Requests follow Triton's vLLM backend (and
Dynamo's KServe frontend), and run through `GenerationService.stream` like every other front:

- inputs: `text_input` BYTES [1] (the prompt), optional `stream` BOOL [1], `sampling_parameters`
  BYTES [1] (a JSON object: max_tokens, temperature, top_p, top_k, seed, stop, stop_token_ids,
  ignore_eos, logprobs, presence/frequency/repetition_penalty, min_p, min_tokens, skip_special_tokens, and vLLM's
  `structured_outputs` {json | json_object | regex | choice | grammar | structural_tag}, enforced token by
  token), `exclude_input_in_output` BOOL [1]; the same sampling keys may come as request
  parameters (the JSON input wins). Triton's vLLM backend's `return_finish_reason`,
  `return_cumulative_logprob`, `return_logprobs`, `return_num_input_tokens`, `return_num_output_tokens`
  BOOL [1] choose the outputs beside `text_output`.
- outputs: `text_output` BYTES [1] and, on the last response, `finish_reason` BYTES [1]
  ("stop" | "length"), `num_input_tokens` and `num_output_tokens` UINT32 [1] (all three when no
  `return_*` input is given; else those asked for), `cumulative_logprob` FP32 [1] and `logprobs`
  BYTES [1] (JSON, as the vLLM backend writes it: per output token {token_id: {logprob, rank,
  decoded_token}}) when asked for; these two make the workers return each token's logprob.
- `ModelStreamInfer` is decoupled: one request, many responses (text deltas when `stream` is true,
  else one response with the whole text); each carries the request's id and the parameter
  `triton_final_response`. Requests on one stream run concurrently. A request's error goes back as
  that response's `error_message` and the stream stays open, as Triton does.
- `ModelInfer` answers one response with the whole text (the prompt first unless
  `exclude_input_in_output`); errors are the call's status (bad input: INVALID_ARGUMENT).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import struct
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from pdserve.v1 import generation_pb2
from pdserve.server import metrics
from pdserve.server.coordinator.openai.errors import ApiError
from pdserve.server.coordinator.openai.structured import structured_output
from pdserve.server.coordinator.json_input import OFF_LOOP_BYTES, JsonRefused, check_json, parse_json, printable
from pdserve.server.coordinator.service import CLIENT_INPUT_ERRORS, GenerationService, RequestFailed
from pdserve.server.coordinator.validate import InvalidRequest
from pdserve.server.finish import finish_name

log = logging.getLogger("pdserve.coordinator.kserve")

SERVICE_NAME = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
MODEL_VERSION = "1"
INPUTS = {  # name: (datatype, model-config type)
    "text_input": ("BYTES", model_config_pb2.TYPE_STRING),
    "stream": ("BOOL", model_config_pb2.TYPE_BOOL),
    "sampling_parameters": ("BYTES", model_config_pb2.TYPE_STRING),
    "exclude_input_in_output": ("BOOL", model_config_pb2.TYPE_BOOL),
    "return_finish_reason": ("BOOL", model_config_pb2.TYPE_BOOL),
    "return_cumulative_logprob": ("BOOL", model_config_pb2.TYPE_BOOL),
    "return_logprobs": ("BOOL", model_config_pb2.TYPE_BOOL),
    "return_num_input_tokens": ("BOOL", model_config_pb2.TYPE_BOOL),
    "return_num_output_tokens": ("BOOL", model_config_pb2.TYPE_BOOL),
}
OUTPUTS = {
    "text_output": ("BYTES", model_config_pb2.TYPE_STRING),
    "finish_reason": ("BYTES", model_config_pb2.TYPE_STRING),
    "cumulative_logprob": ("FP32", model_config_pb2.TYPE_FP32),
    "logprobs": ("BYTES", model_config_pb2.TYPE_STRING),
    "num_input_tokens": ("UINT32", model_config_pb2.TYPE_UINT32),
    "num_output_tokens": ("UINT32", model_config_pb2.TYPE_UINT32),
}
RETURN_INPUTS = {f"return_{name}": name for name in OUTPUTS if name != "text_output"}
"""Triton vLLM backend's switches: `return_<output>` asks for that output."""
DEFAULT_RETURNS = ("finish_reason", "num_input_tokens", "num_output_tokens")
"""What the last response carries when the request has no `return_*` input."""
SAMPLING_KEYS = {
    "max_tokens": int,
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "seed": int,
    "stop": list,
    "stop_token_ids": list,
    "ignore_eos": bool,
    "logprobs": int,
    "presence_penalty": float,
    "frequency_penalty": float,
    "repetition_penalty": float,
    "min_p": float,
    "min_tokens": int,
    "skip_special_tokens": bool,
}
NEUTRAL_KEYS = {
    "n": 1,
    "best_of": 1,
}
"""vLLM sampling keys accepted at their neutral value only (the engine has no such knob)."""


class BadInput(ValueError):
    """A malformed inference request: INVALID_ARGUMENT, or a stream response's error_message."""


def _json(raw: bytes | str, field: str) -> Any:
    """A JSON input or parameter, parsed and checked (json_input.py: depth, encodable strings, integer
    range, finite floats), or BadInput naming it."""
    try:
        value = parse_json(raw, field)
        check_json(value, field)
    except JsonRefused as e:
        raise BadInput(str(e)) from None
    return value


def _shown(value: Any) -> str:
    """A client's value quoted in a message: short, and printable whatever it holds."""
    text = printable(repr(value))
    return text if len(text) <= 80 else text[:77] + "..."


# --- decoding a ModelInferRequest ----------------------------------------------------------------


def _bytes_elements(raw: bytes) -> list[bytes]:
    """Triton's BYTES tensor wire format (each element a little-endian uint32 length, then the bytes),
    read by tritonclient's own codec."""
    try:
        return list(deserialize_bytes_tensor(raw))
    except struct.error as e:
        raise BadInput(f"a BYTES tensor is truncated: {e}") from e


def _bytes_tensor(values: list[bytes]) -> bytes:
    return serialize_byte_tensor(np.array(values, dtype=np.object_)).item()  # a 0-d array holding the bytes


def _input_values(request: service_pb2.ModelInferRequest) -> dict[str, list[Any]]:
    """Each input's elements, from raw_input_contents (what tritonclient sends) or typed contents."""
    if request.raw_input_contents and len(request.raw_input_contents) != len(request.inputs):
        raise BadInput(
            f"{len(request.inputs)} inputs but {len(request.raw_input_contents)} raw_input_contents"
        )
    values: dict[str, list[Any]] = {}
    for i, tensor in enumerate(request.inputs):
        if tensor.name not in INPUTS:
            raise BadInput(f"unknown input {tensor.name!r}; the inputs are {', '.join(INPUTS)}")
        datatype = INPUTS[tensor.name][0]
        if tensor.datatype != datatype:
            raise BadInput(
                f"input {tensor.name!r} must be {datatype}, got {tensor.datatype or 'no datatype'}"
            )
        if "shared_memory_region" in tensor.parameters:
            raise BadInput(f"input {tensor.name!r}: shared memory inputs are not supported")
        if request.raw_input_contents:
            raw = request.raw_input_contents[i]
            elements: list[Any] = _bytes_elements(raw) if datatype == "BYTES" else [b != 0 for b in raw]
        else:
            elements = list(
                tensor.contents.bytes_contents if datatype == "BYTES" else tensor.contents.bool_contents
            )
        count = 1
        for d in tensor.shape:
            count *= d
        if count != len(elements):
            raise BadInput(
                f"input {tensor.name!r} has shape {list(tensor.shape)} but {len(elements)} elements"
            )
        if len(elements) != 1:
            raise BadInput(
                f"input {tensor.name!r} must hold one element (shape [1]); batches are not supported"
            )
        values[tensor.name] = elements
    return values


def _parameter(p: service_pb2.InferParameter) -> Any:
    kind = p.WhichOneof("parameter_choice")
    return getattr(p, kind) if kind else None


def _coerce(key: str, value: Any) -> Any:
    kind = SAMPLING_KEYS[key]
    try:
        if kind is list:
            if key == "stop" and isinstance(value, str):
                value = _json(value, key) if value.startswith("[") else [value]
            if key == "stop_token_ids" and isinstance(value, str):
                value = _json(value, key)
            if not isinstance(value, list):
                raise TypeError
            return [int(v) for v in value] if key == "stop_token_ids" else [str(v) for v in value]
        if kind is bool:
            if isinstance(value, str):
                if value.lower() not in ("true", "false"):
                    raise ValueError
                return value.lower() == "true"
            return bool(value)
        if kind is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        return kind(value)
    except BadInput:
        raise
    except (TypeError, ValueError, OverflowError) as e:
        raise BadInput(f"sampling parameter {key}: {_shown(value)} is not a valid {kind.__name__}") from e


def sampling_from(params: dict[str, Any], strict: bool) -> generation_pb2.SamplingParams:
    """vLLM-style sampling keys to SamplingParams; `strict` refuses unknown keys (the JSON input)."""
    sampling = generation_pb2.SamplingParams()
    for key, value in params.items():
        if key == "structured_outputs":
            if isinstance(value, str):  # a request parameter holds it as JSON text
                value = _json(value, "structured_outputs")
            if not isinstance(value, dict):
                raise BadInput("structured_outputs: a JSON object, e.g. {\"regex\": \"[a-z]+\"}")
            try:
                sampling.structured.CopyFrom(structured_output(None, value))
            except ApiError as e:
                raise BadInput(e.message) from e
            continue
        if key in NEUTRAL_KEYS:
            if value != NEUTRAL_KEYS[key]:
                raise BadInput(f"sampling parameter {key}={_shown(value)} is not supported")
            continue
        if key not in SAMPLING_KEYS:
            if strict:
                raise BadInput(f"unknown sampling parameter {key!r}; known: {', '.join(SAMPLING_KEYS)}")
            continue
        value = _coerce(key, value)
        try:
            if key in ("stop", "stop_token_ids"):
                getattr(sampling, key).extend(value)
            else:
                setattr(sampling, key, value)
        except (TypeError, ValueError) as e:
            raise BadInput(f"sampling parameter {key}: {_shown(value)} is out of range") from e
    return sampling


@dataclass
class Inference:
    """One decoded KServe request."""

    id: str
    prompt: str
    stream: bool
    exclude_input: bool
    sampling: generation_pb2.SamplingParams
    outputs: list[str] = field(default_factory=list)
    """The outputs the client asked for (empty: all)."""
    returns: tuple[str, ...] = DEFAULT_RETURNS
    """The outputs beside text_output on the last response (`return_*` inputs, else the default)."""
    timeout: float | None = None

    def generate_request(self) -> generation_pb2.GenerateRequest:
        return generation_pb2.GenerateRequest(
            request_id=self.id[:256], text=self.prompt, sampling=self.sampling
        )


async def parse_request(request: service_pb2.ModelInferRequest) -> Inference:
    """The one place a KServe request is read: `parse`, in a thread for a large request; what reading it
    raises past the field checks (CLIENT_INPUT_ERRORS) is BadInput, anything else a server error."""
    try:
        if request.ByteSize() > OFF_LOOP_BYTES:
            return await asyncio.to_thread(parse, request)
        return parse(request)
    except CLIENT_INPUT_ERRORS as e:
        log.warning("reading a KServe request raised %r past the field checks", e)
        raise BadInput(f"the request cannot be read ({type(e).__name__}: {printable(str(e))[:200]})") from e


def parse(request: service_pb2.ModelInferRequest) -> Inference:
    values = _input_values(request)
    if "text_input" not in values:
        raise BadInput("input 'text_input' (BYTES, shape [1]) is required")
    try:
        prompt = values["text_input"][0].decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadInput(f"text_input is not UTF-8: {e}") from e
    params = {k: _parameter(v) for k, v in request.parameters.items()}
    sampling = sampling_from(params, strict=False)
    if "sampling_parameters" in values:
        given = _json(values["sampling_parameters"][0] or b"{}", "sampling_parameters")
        if not isinstance(given, dict):
            raise BadInput("sampling_parameters must be a JSON object")
        sampling.MergeFrom(sampling_from(given, strict=True))
    for out in request.outputs:
        if out.name not in OUTPUTS:
            raise BadInput(f"unknown output {out.name!r}; the outputs are {', '.join(OUTPUTS)}")
    returns = DEFAULT_RETURNS
    if any(name in values for name in RETURN_INPUTS):  # a Triton vLLM backend client: what it asks for
        returns = tuple(out for name, out in RETURN_INPUTS.items() if values.get(name, [False])[0])
    if {"logprobs", "cumulative_logprob"} & set(returns) and not sampling.HasField("logprobs"):
        sampling.logprobs = 0  # the chosen tokens' logprobs are needed
    timeout_us = params.get("timeout")
    return Inference(
        id=request.id,
        prompt=prompt,
        stream=bool(values.get("stream", [False])[0]),
        exclude_input=bool(values.get("exclude_input_in_output", [False])[0]),
        sampling=sampling,
        outputs=[o.name for o in request.outputs],
        returns=returns,
        timeout=timeout_us / 1e6 if isinstance(timeout_us, int) and timeout_us > 0 else None,
    )


# --- the servicer -------------------------------------------------------------------------------


@dataclass
class Output:
    text: str
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[generation_pb2.TokenLogprob] = field(default_factory=list)
    """Every output token's, when asked for."""


def _logprobs_json(entries: list[generation_pb2.TokenLogprob], token_text: Callable[[int], str]) -> str:
    """As Triton's vLLM backend writes them: per token {token_id: {logprob, rank, decoded_token}}."""
    out = []
    for e in entries:
        ranked = {t: (lp, rank) for rank, (t, lp) in enumerate(zip(e.top_token_ids, e.top_logprobs), start=1)}
        ranked.setdefault(e.token_id, (e.logprob, None))
        out.append({str(t): {"logprob": lp, "rank": rank, "decoded_token": token_text(t)}
                    for t, (lp, rank) in ranked.items()})
    return json.dumps(out)


def _infer_response(
    model: str, inference: Inference, out: Output, final: bool, token_text: Callable[[int], str] = str
) -> service_pb2.ModelInferResponse:
    response = service_pb2.ModelInferResponse(model_name=model, model_version=MODEL_VERSION, id=inference.id)
    tensors: list[tuple[str, str, bytes]] = [("text_output", "BYTES", _bytes_tensor([out.text.encode()]))]
    if out.finish_reason is not None:
        extra = {
            "finish_reason": ("BYTES", lambda: _bytes_tensor([out.finish_reason.encode()])),
            "cumulative_logprob": ("FP32", lambda: struct.pack("<f", sum(e.logprob for e in out.logprobs))),
            "logprobs": ("BYTES", lambda: _bytes_tensor([_logprobs_json(out.logprobs, token_text).encode()])),
            "num_input_tokens": ("UINT32", lambda: struct.pack("<I", out.prompt_tokens)),
            "num_output_tokens": ("UINT32", lambda: struct.pack("<I", out.completion_tokens)),
        }
        tensors += [(name, datatype, raw()) for name, (datatype, raw) in extra.items() if name in inference.returns]
    for name, datatype, raw in tensors:
        if inference.outputs and name not in inference.outputs:
            continue
        response.outputs.add(name=name, datatype=datatype, shape=[1])
        response.raw_output_contents.append(raw)
    response.parameters["triton_final_response"].bool_param = final
    return response


def _min_timeout(*timeouts: float | None) -> float | None:
    given = [t for t in timeouts if t is not None]
    return min(given) if given else None


class KServeService(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(
        self, generation: GenerationService, model_name: str, ready: Callable[[], bool], max_model_len: int
    ):
        self.generation = generation
        self.model_name = model_name
        self.ready = ready
        self.max_model_len = max_model_len

    # --- health and metadata ---

    async def ServerLive(self, request, context):
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return service_pb2.ServerReadyResponse(ready=self.ready())

    async def ModelReady(self, request, context):
        return service_pb2.ModelReadyResponse(
            ready=self._known(request.name, request.version) and self.ready()
        )

    async def ServerMetadata(self, request, context):
        try:
            pdserve_version = version("pdserve")
        except PackageNotFoundError:
            pdserve_version = "0"
        return service_pb2.ServerMetadataResponse(name="pdserve", version=pdserve_version, extensions=[])

    async def ModelMetadata(self, request, context):
        await self._check_model(request.name, request.version, context)
        return service_pb2.ModelMetadataResponse(
            name=self.model_name,
            versions=[MODEL_VERSION],
            platform="pdserve",
            inputs=[
                service_pb2.ModelMetadataResponse.TensorMetadata(name=n, datatype=d, shape=[1])
                for n, (d, _) in INPUTS.items()
            ],
            outputs=[
                service_pb2.ModelMetadataResponse.TensorMetadata(name=n, datatype=d, shape=[-1])
                for n, (d, _) in OUTPUTS.items()
            ],
        )

    async def ModelConfig(self, request, context):
        await self._check_model(request.name, request.version, context)
        config = model_config_pb2.ModelConfig(
            name=self.model_name,
            platform="pdserve",
            backend="pdserve",
            max_batch_size=0,
            input=[
                model_config_pb2.ModelInput(name=n, data_type=t, dims=[1], optional=n != "text_input")
                for n, (_, t) in INPUTS.items()
            ],
            output=[
                model_config_pb2.ModelOutput(name=n, data_type=t, dims=[-1]) for n, (_, t) in OUTPUTS.items()
            ],
            model_transaction_policy=model_config_pb2.ModelTransactionPolicy(decoupled=True),
        )
        return service_pb2.ModelConfigResponse(config=config)

    def _known(self, name: str, version_: str) -> bool:
        """The served model, or a LoRA adapter it serves (--enable-lora), by name."""
        return (name == self.model_name or self._adapter(name)) and version_ in ("", MODEL_VERSION)

    def _adapter(self, name: str) -> bool:
        adapters = getattr(self.generation, "adapters", None)
        return bool(name) and adapters is not None and adapters.get(name) is not None

    async def _check_model(self, name: str, version_: str, context: grpc.aio.ServicerContext) -> None:
        if not self._known(name, version_):
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"unknown model {name!r} version {version_!r}; this server serves {self.model_name!r} "
                f"version {MODEL_VERSION!r}",
            )

    # --- inference ---

    async def _run(
        self, inference: Inference, timeout: float | None, model: str
    ) -> AsyncIterator[service_pb2.ModelInferResponse]:
        """The request's responses: text deltas when streaming, else one with the whole text. model: the name the
        request gave (a LoRA adapter's runs with it)."""
        kind = inference.sampling.structured.WhichOneof("kind")
        if kind:  # checked by a grammar child of this process; the refusal names KServe's field
            try:
                await self.generation.check_spec(inference.sampling.structured,
                                                 f"structured_outputs.{'json' if kind == 'json_schema' else kind}")
            except InvalidRequest as e:
                raise BadInput(str(e)) from e
        generate = inference.generate_request()
        generate.lora_name = "" if model == self.model_name else model
        stream = self.generation.stream(generate, _min_timeout(timeout, inference.timeout))
        text = "" if inference.stream or inference.exclude_input else inference.prompt
        logprobs: list[generation_pb2.TokenLogprob] = []
        async with contextlib.aclosing(stream):
            async for r in stream:
                logprobs.extend(r.logprobs)
                out = Output(r.text)
                if r.finish_reason:
                    out = Output(
                        r.text,
                        finish_name(r.finish_reason),
                        r.usage.prompt_tokens,
                        r.usage.completion_tokens,
                        logprobs,
                    )
                if inference.stream:
                    if out.text or out.finish_reason:
                        yield _infer_response(model, inference, out, bool(out.finish_reason),
                                              self._token_text)
                    continue
                text += out.text
                if out.finish_reason:
                    out.text = text
                    yield _infer_response(model, inference, out, True, self._token_text)

    def _token_text(self, token_id: int) -> str:
        tokenizer = self.generation.tokenizer
        if hasattr(tokenizer, "token_text"):  # a SentencePiece "▁" a space even at the start
            return tokenizer.token_text(token_id)
        return tokenizer.decode([token_id], skip_special_tokens=False)

    async def ModelInfer(self, request, context):
        if not self._known(request.model_name, request.model_version):
            await self._check_model(request.model_name, request.model_version, context)
        try:
            inference = await parse_request(request)
            if inference.stream:
                raise BadInput("stream=true needs ModelStreamInfer (decoupled); ModelInfer answers once")
            responses = [r async for r in self._run(inference, context.time_remaining(), request.model_name)]
        except (BadInput, InvalidRequest) as e:
            _count(e)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RequestFailed as e:
            await context.abort(e.code, e.details, e.metadata)
        return responses[-1]

    async def ModelStreamInfer(self, request_iterator, context):
        responses: asyncio.Queue[service_pb2.ModelStreamInferResponse | None] = asyncio.Queue()
        timeout = context.time_remaining()

        async def read_requests() -> None:
            async with asyncio.TaskGroup() as group:
                async for request in request_iterator:
                    group.create_task(self._stream_one(request, timeout, responses.put_nowait))

        reader = asyncio.create_task(read_requests())
        reader.add_done_callback(lambda _: responses.put_nowait(None))
        try:
            while (response := await responses.get()) is not None:
                yield response
            await reader  # re-raises what ended it, if anything did
        finally:
            if not reader.done():
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reader

    async def _stream_one(
        self,
        request: service_pb2.ModelInferRequest,
        timeout: float | None,
        emit: Callable[[service_pb2.ModelStreamInferResponse], None],
    ) -> None:
        def error(message: str) -> None:
            emit(
                service_pb2.ModelStreamInferResponse(
                    error_message=message, infer_response=service_pb2.ModelInferResponse(id=request.id)
                )
            )

        if not self._known(request.model_name, request.model_version):
            error(
                f"unknown model {request.model_name!r} version {request.model_version!r}; "
                f"this server serves {self.model_name!r}"
            )
            return
        try:
            inference = await parse_request(request)
            async for response in self._run(inference, timeout, request.model_name):
                emit(service_pb2.ModelStreamInferResponse(infer_response=response))
        except (BadInput, InvalidRequest) as e:
            _count(e)
            error(f"INVALID_ARGUMENT: {e}")
        except RequestFailed as e:
            log.warning("stream request %r failed: %s", request.id, e)
            error(f"{e.code.name}: {e.details}")


def _count(e: Exception) -> None:
    """Requests refused here, before the shared request path (which counts its own refusals)."""
    if isinstance(e, BadInput):
        metrics.request_failure.labels(grpc.StatusCode.INVALID_ARGUMENT.name).inc()


def add_to_server(service: KServeService, server: grpc.aio.Server) -> None:
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(service, server)
