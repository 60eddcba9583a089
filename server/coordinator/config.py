"""The coordinator's settings, checked when built."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pdserve.server.choices import (
    DECODE_POLICIES,
    DECODE_STREAMS,
    PREFILL_POLICIES,
    TOOL_CALL_PARSERS,
    DecodePolicy,
    DecodeStreams,
    PrefillPolicy,
    ToolCallParser,
)
from pdserve.kvcache.block_hash import DEFAULT_HASH_ALGO, BlockHasher, PrefixCachingHashAlgo
from pdserve.server.flags import flag
from pdserve.server.lora_config import check_max_lora_rank, parse_lora_modules
from pdserve.server.structured.limits import check_grammar_settings


def _check_address(address: str, flag: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{flag}: {address!r} is not HOST:PORT (for example 127.0.0.1:50061)")


@dataclass
class CoordinatorConfig:
    model_dir: Path = field(metadata=flag(cli=False))
    """The checkpoint directory: config.json for the limits, tokenizer.json for text."""
    port: int = 50051
    """The gRPC port (public API and registry); 0 picks a free port."""
    host: str = "127.0.0.1"
    prefill_addresses: list[str] = field(default_factory=list, metadata=flag("--prefill", metavar="HOST:PORT"))
    """A prefill worker (repeatable); workers may also register themselves."""
    decode_addresses: list[str] = field(default_factory=list, metadata=flag("--decode", metavar="HOST:PORT"))
    """A decode worker (repeatable); workers may also register themselves."""
    lease_seconds: float = field(default=30.0, metadata=flag(cli=False))
    """How long a decode worker holds a request's blocks while waiting for its KV."""
    refresh_seconds: float = field(default=0.5, metadata=flag(cli=False))
    """How often every worker's GetInfo (readiness and load) is polled."""
    grace_seconds: float = field(default=5.0, metadata=flag(cli=False))
    """On shutdown, how long in-flight requests may run before they are cancelled."""
    heartbeat_timeout: float = 3.0
    """A registered worker without a heartbeat for this long is dead (`--heartbeat-timeout`)."""
    max_queue: int = 256
    """Requests that may wait per tier for a worker with room; more get RESOURCE_EXHAUSTED (`--max-queue`)."""
    default_timeout: float = 600.0
    """The deadline of a request whose client set none (`--default-timeout`)."""
    prefill_policy: PrefillPolicy = "least-queued"
    """How a prefill worker is picked."""
    decode_policy: DecodePolicy = "prefix-aware"
    """How a decode worker is picked (prefix-aware: by the prompt's first blocks, load bounded)."""
    ttft_budget: float = 0.0
    """Refuse (RESOURCE_EXHAUSTED) a request whose expected prefill wait (worst case) exceeds this many
    seconds; an admitted one's first token is due within it (the prefill worker runs it ahead of later
    work once its slack runs out); 0: only its deadline bounds the wait (`--ttft-budget`, prefill_estimate.py)."""
    conditional_disagg_max_uncached: int = 0
    """Conditional disaggregation: a decode worker that holds at least --conditional-disagg-min-cached of a prompt's
    tokens (a conversation's history, its answers included) and lacks fewer than this many prefills them itself, with
    no prefill worker and no KV transfer (conditional disaggregation as Dynamo's and llm-d's routers do it, by the
    uncached suffix's length); longer suffixes go to the prefill tier, which sends only the blocks the decode worker
    lacks. 0 (the default): off, every prompt is prefilled on the prefill tier while one is alive; 2048 is Dynamo's
    threshold. Off by default because it moves compute: the decode worker prefills in its own dtype and kernels
    (a bf16 checkpoint's decode worker in bf16 where the prefill tier upcasts to fp32), so near-tied greedy tokens
    can differ from the disaggregated path's, and the decode batch shares its steps with those prefills."""
    conditional_disagg_min_cached: int = 1
    """How many of the prompt's tokens the decode worker must already hold for conditional disaggregation: 1 (the
    default) takes any cached block, so a conversation's later turns stay local and a new prompt goes to the prefill
    tier; 0 prefills every short prompt on the decode worker, cached or not."""
    kv_events_subscribe: bool = True
    """Read the KV events of every worker that publishes them (--kv-events-config on the workers: each advertises
    its bound endpoint, replay endpoint and topic at registration and in GetInfo) into this coordinator's KV index,
    and route by what each worker holds (kv_routing.py): the prefix-aware decode policy and the prefill pick go by
    the least expected cost, rendezvous hashing and least-queued staying the fallback for workers that publish
    nothing. On start each worker's view is read through its replay endpoint, so replicas converge on one view."""
    prefix_caching_hash_algo: PrefixCachingHashAlgo = DEFAULT_HASH_ALGO
    """How the workers name KV blocks (vLLM's flag; give every process the same, and the same PYTHONHASHSEED): the
    coordinator hashes prompts alike to look them up in its KV index."""
    kv_overlap_score_weight: float = 1.0
    """KV routing's weight of a block to compute (or to load) against a block of decode load (Dynamo's
    --kv-overlap-score-weight): higher follows cached prefixes harder, 0 routes by load alone."""
    kv_index_max_blocks: int = 1 << 19
    """Block hashes the KV index keeps per worker (the oldest stored go first beyond it)."""
    max_migrations: int = 2
    """How often one request may move to another decode worker when its worker dies (`--max-migrations`)."""
    stall_timeout: float = 10.0
    """A decode stream that sends nothing this long after its first event is migrated as if its worker had
    died (`--stall-timeout`); before it, the worker waits on the KV or prefills the prompt itself."""
    max_prompt_bytes: int = 4 * 2**20
    """Text prompts (and chat messages together) longer than this are refused before any work."""
    api_key: str | None = None
    """The public API needs `authorization: Bearer KEY` when set (`--api-key` or $PDSERVE_API_KEY)."""
    metrics_port: int = field(default=0, metadata=flag(cli=False))
    """Prometheus /metrics on this port; 0: off (a flag every role shares)."""
    worker_metrics: list[str] = field(default_factory=list, metadata=flag("--worker-metrics", metavar="NAME=HOST:PORT"))
    """A worker's own /metrics (repeatable; `pdserve up` gives each): the HTTP front's /metrics serves its series
    too, labelled engine (its place in this list, as vLLM numbers its engines) and worker (NAME)."""
    http_port: int | None = None
    """Serve the OpenAI-compatible HTTP API on this port (0: a free one); none: off."""
    served_model_name: tuple[str, ...] = ()
    """The names clients give `model` (vLLM's flag); the first is the one reported. Default: the model
    id, or the checkpoint directory's name."""
    max_model_len: int | None = None
    """Longest prompt + output served (vLLM's flag); at most the model's own. Default: the model's."""
    chat_template: str | None = None
    """A Jinja chat template, or a file holding one, used instead of the model's (vLLM's flag)."""
    enable_auto_tool_choice: bool = False
    """Serve `tool_choice: "auto"`: calls parsed out of the model's text by --tool-call-parser (vLLM's flag)."""
    tool_call_parser: ToolCallParser | None = None
    """The format the model writes its tool calls in (vLLM's flag): hermes (Qwen, Hermes), llama3_json, mistral."""
    registry_port: int | None = None
    """Serve the worker Registry only on this internal port (`--registry-port`; 0 picks one); None: on `port`."""
    decode_streams: DecodeStreams = "batched"
    """batched: each decode worker sends one message per step for every request on this coordinator (its
    Steps stream); per-request: one message per token per request (workers without Steps get that anyway)."""
    max_coalesce: int = 64
    """Adaptive coalescing: tokens that arrive while a stream is still writing its previous response go out
    together in its next one, up to this many per response (1: off, one response per decode event). There
    is no timer: a token that could be written now is never held back, so a stream that keeps up gets one
    response per decode step, and one that falls behind catches up in fewer, larger ones (as vLLM's
    output collector merges what a slow consumer has not taken)."""
    reuse_port: bool = False
    """Bind the public ports with SO_REUSEPORT, so several coordinator processes share them (`--reuse-port`)."""

    grammar_processes: int = 2
    """Child processes that check (and on a worker trial-compile) structured-output specs, so a spec that
    crashes or stalls the grammar compiler kills only a child and is refused."""
    grammar_timeout: float = 10.0
    """Seconds a spec's check in a grammar child, and its compile, may take before it is refused as too complex."""
    max_spec_bytes: int = 256 * 1024
    """A structured-output schema's, regex's, grammar's or structural tag's UTF-8 size."""
    max_schema_depth: int = 128
    """How deep a JSON schema's objects and arrays may nest."""
    max_schema_defs: int = 256
    """`$defs` and `definitions` entries in one JSON schema, all levels together."""
    max_grammar_rules: int = 1024
    """Rules in a Lark or GBNF grammar."""
    max_tools: int = 128
    """OpenAI tools in one request."""
    max_tool_schema_bytes: int = 256 * 1024
    """One request's tool `parameters` schemas together, as JSON bytes."""
    enable_lora: bool = False
    """vLLM's flag: serve LoRA adapters, which a request names as its model (the decode workers need it too)."""
    lora_modules: tuple[str, ...] = ()
    """vLLM's flag: adapters served from the start, each name=path or '{"name": ..., "path": ...,
    "base_model_name": ...}' (a PEFT checkpoint's folder: adapter_config.json + adapter_model.safetensors).
    With VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, POST /v1/load_lora_adapter and /v1/unload_lora_adapter change them."""
    max_lora_rank: int = 16
    """vLLM's flag: the largest adapter rank served, one of 1, 8, 16, 32, 64, 128, 256, 320, 512 (a larger one is
    refused at load)."""

    def __post_init__(self) -> None:
        check_grammar_settings(self)
        self.model_dir = Path(self.model_dir)
        self.prefill_addresses = list(self.prefill_addresses)
        self.decode_addresses = list(self.decode_addresses)
        if not self.model_dir.is_dir():
            raise ValueError(f"model_dir {str(self.model_dir)!r} is not a directory")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must lie in [0, 65535], got {self.port}")
        if not self.host:
            raise ValueError("host must not be empty")
        if self.registry_port is not None and not 0 <= self.registry_port < 65536:
            raise ValueError(f"--registry-port must lie in [0, 65535], got {self.registry_port}")
        if self.http_port is not None and not 0 <= self.http_port < 65536:
            raise ValueError(f"http_port must lie in [0, 65535], got {self.http_port}")
        for flag, addresses in (
            ("prefill_addresses", self.prefill_addresses),
            ("decode_addresses", self.decode_addresses),
        ):
            for address in addresses:
                _check_address(address, flag)
        self.worker_metrics = list(self.worker_metrics)
        for entry in self.worker_metrics:
            name, sep, address = entry.partition("=")
            if not sep or not name:
                raise ValueError(f"--worker-metrics: {entry!r} is not NAME=HOST:PORT (for example decode-0=127.0.0.1:9101)")
            _check_address(address, "--worker-metrics")
        every = [*self.prefill_addresses, *self.decode_addresses]
        duplicates = sorted({a for a in every if every.count(a) > 1})
        if duplicates:
            raise ValueError(f"worker addresses given twice: {', '.join(duplicates)}")
        if not self.lease_seconds > 0:
            raise ValueError(f"lease_seconds must be > 0, got {self.lease_seconds}")
        if not self.refresh_seconds > 0:
            raise ValueError(f"refresh_seconds must be > 0, got {self.refresh_seconds}")
        if not self.grace_seconds >= 0:
            raise ValueError(f"grace_seconds must be >= 0, got {self.grace_seconds}")
        if not self.heartbeat_timeout > 0:
            raise ValueError(f"--heartbeat-timeout must be > 0, got {self.heartbeat_timeout}")
        if self.max_queue < 0:
            raise ValueError(f"--max-queue must be >= 0, got {self.max_queue}")
        if not self.default_timeout > 0:
            raise ValueError(f"--default-timeout must be > 0, got {self.default_timeout}")
        if not self.ttft_budget >= 0:
            raise ValueError(f"--ttft-budget must be >= 0 seconds, got {self.ttft_budget}")
        if not self.stall_timeout > 0:
            raise ValueError(f"--stall-timeout must be > 0, got {self.stall_timeout}")
        if self.max_prompt_bytes <= 0:
            raise ValueError(f"--max-prompt-bytes must be > 0, got {self.max_prompt_bytes}")
        for name in ("conditional_disagg_max_uncached", "conditional_disagg_min_cached"):
            if not 0 <= getattr(self, name) < 2**32:  # a uint32 on the wire
                raise ValueError(f"--{name.replace('_', '-')} must lie in [0, 2**32) tokens, got {getattr(self, name)}"
                                 + (" (0 turns it off)" if name.endswith("uncached") else ""))
        BlockHasher(self.prefix_caching_hash_algo)  # refuses an unknown algorithm, or xxhash without the package
        if not self.kv_overlap_score_weight >= 0:
            raise ValueError(f"--kv-overlap-score-weight must be >= 0, got {self.kv_overlap_score_weight}")
        if self.kv_index_max_blocks < 1:
            raise ValueError(f"--kv-index-max-blocks must be >= 1, got {self.kv_index_max_blocks}")
        if self.max_migrations < 0:
            raise ValueError(f"--max-migrations must be >= 0, got {self.max_migrations}")
        if self.prefill_policy not in PREFILL_POLICIES:
            raise ValueError(f"--prefill-policy must be one of {', '.join(PREFILL_POLICIES)}, got {self.prefill_policy!r}")
        if self.decode_policy not in DECODE_POLICIES:
            raise ValueError(f"--decode-policy must be one of {', '.join(DECODE_POLICIES)}, got {self.decode_policy!r}")
        if self.decode_streams not in DECODE_STREAMS:
            raise ValueError(f"--decode-streams must be one of {', '.join(DECODE_STREAMS)}, got {self.decode_streams!r}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got "
                             f"{self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (the format the model writes "
                             f"its calls in: {', '.join(TOOL_CALL_PARSERS)})")
        if self.max_coalesce < 1:
            raise ValueError(f"--max-coalesce must be >= 1 token, got {self.max_coalesce}")
        self.served_model_name = tuple(self.served_model_name)
        self.lora_modules = tuple(self.lora_modules)
        parse_lora_modules(self.lora_modules)
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        check_max_lora_rank(self.max_lora_rank)
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"--max-model-len must be >= 1, got {self.max_model_len}")

    @property
    def model_name(self) -> str:
        """The name reported to clients and on every metric."""
        return self.served_model_name[0] if self.served_model_name else self.model_dir.resolve().name
