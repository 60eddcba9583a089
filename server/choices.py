"""The closed choices pdserve's settings take, in one place: each a `Literal` (for the config
dataclasses and type checkers) and its values (for argparse choices and validation).

Beside them, how vLLM spells the same choices (`--dtype half`, `--kv-cache-dtype fp8`,
`--quantization fp8`), so a `vllm serve` command line carries over.
"""

from __future__ import annotations

from typing import Literal, get_args

WeightDtype = Literal["auto", "float32", "bfloat16", "int8", "fp8"]
"""auto: the checkpoint's; int8/fp8: weight-only, one scale per output channel, quantized at load."""
KvDtypeChoice = Literal["auto", "float32", "bfloat16", "float16", "fp8_e4m3", "int8"]
"""The decode tier's KV cache (and so the wire's); auto: the model's compute dtype."""
PrefillPolicy = Literal["least-queued"]
DecodePolicy = Literal["prefix-aware", "most-free-blocks", "power-of-two"]
LogFormat = Literal["text", "json"]
DecodeStreams = Literal["batched", "per-request"]
"""How decode workers stream to the coordinator: batched (one message per step per connection, the
workers' Steps stream) or per-request (one message per token per request, the pre-Steps wire)."""
CpuMatmul = Literal["auto", "onednn", "plain", "float32", "float32-onednn"]
"""How a checkpoint's matmuls compute on a CPU decode worker (`server/decode/cpu_matmul.py`)."""
PrefillMatmul = Literal["auto", "xla-fp32", "xla-bf16", "onednn-bf16"]
"""How a CPU prefill worker's layer matmuls compute (`server/prefill/matmul_choice.py`); auto: the fastest measured."""
PrefillAttention = Literal["auto", "xla", "host"]
"""Where a CPU prefill worker's attention runs with --prefill-matmul onednn-bf16 (`server/prefill/matmul_choice.py`):
xla (attention.py's blockwise), host (torch's flash attention, host_attention.py); auto: the faster measured."""
EngineKind = Literal["native", "vllm"]
"""native: pdserve's torch engine; vllm: vLLM's engine fed through pdserve's KV connector."""
ToolCallParser = Literal["hermes", "llama3_json", "mistral"]
"""How a model writes tool calls in its text (vLLM's --tool-call-parser names; coordinator/openai/tool_parsers.py)."""

WEIGHT_DTYPES: tuple[str, ...] = get_args(WeightDtype)
KV_DTYPES: tuple[str, ...] = get_args(KvDtypeChoice)
PREFILL_POLICIES: tuple[str, ...] = get_args(PrefillPolicy)
DECODE_POLICIES: tuple[str, ...] = get_args(DecodePolicy)
LOG_FORMATS: tuple[str, ...] = get_args(LogFormat)
DECODE_ENGINES: tuple[str, ...] = get_args(EngineKind)
CPU_MATMULS: tuple[str, ...] = get_args(CpuMatmul)
PREFILL_MATMULS: tuple[str, ...] = get_args(PrefillMatmul)
PREFILL_ATTENTIONS: tuple[str, ...] = get_args(PrefillAttention)
DECODE_STREAMS: tuple[str, ...] = get_args(DecodeStreams)
TOOL_CALL_PARSERS: tuple[str, ...] = get_args(ToolCallParser)

VLLM_DTYPES: dict[str, str] = {"auto": "auto", "float32": "float32", "float": "float32", "bfloat16": "bfloat16"}
"""vLLM's `--dtype` values pdserve serves, as its weight dtype (`half`/`float16` weights are not served)."""
VLLM_QUANTIZATIONS: dict[str, str] = {"fp8": "fp8", "int8": "int8"}
"""vLLM's `--quantization` values pdserve serves (weight-only, quantized at load); int8 is pdserve's own."""
VLLM_KV_CACHE_DTYPES: dict[str, str] = {"auto": "auto", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "int8": "int8",
                                        "bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}
"""vLLM's `--kv-cache-dtype` values pdserve serves, as its KV dtype."""


def translate(flag: str, value: str, table: dict[str, str]) -> str:
    """A vLLM spelling to pdserve's value; ValueError naming the flag and what it takes."""
    if value not in table:
        raise ValueError(f"{flag} {value!r} is not served by pdserve; it takes {', '.join(table)}")
    return table[value]
