"""The prefill worker's settings, validated at construction; its flags are generated from them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pdserve.kvcache.block_hash import DEFAULT_HASH_ALGO, BlockHasher, PrefixCachingHashAlgo
from pdserve.kvcache.kv_events_config import KvEventsConfig, parse_kv_events_config
from pdserve.server.choices import (PREFILL_ATTENTIONS, PREFILL_MATMULS, WEIGHT_DTYPES, PrefillAttention, PrefillMatmul,
                                    WeightDtype)
from pdserve.server.flags import flag
from pdserve.server.kv_offloading import KvOffloadingConfig
from pdserve.server.lora_config import LoraConfig
from pdserve.server.prefill.scheduler import PREFILL_ORDERS, PrefillOrder
from pdserve.server.prefill.warmup import COMPILE_BEFORE_SERVING, CompileBeforeServing
from pdserve.server.structured.limits import check_grammar_settings


@dataclass(frozen=True)
class PrefillConfig(KvOffloadingConfig, LoraConfig):
    """The prefill worker's settings; the offload tiers' (`--kv-offloading-*`) come from KvOffloadingConfig, the
    LoRA adapters' (`--enable-lora`, `--max-loras`, ...: the decode workers' flags) from LoraConfig."""

    model_dir: Path = field(metadata=flag(cli=False))
    port: int = 0
    """The gRPC port; 0 picks a free port."""
    host: str = "127.0.0.1"
    max_batch_size: int = 8
    """Most prompts (or chunks of prompts) packed into one step."""
    max_batch_tokens: int = field(default=8192, metadata=flag("--max-batch-tokens", "--max-num-batched-tokens"))
    """Token slots of one step, the prompts packed end to end (vLLM: --max-num-batched-tokens); steps
    run at power-of-two sizes up to it."""
    max_prefill_chunk: int | None = None
    """Prompts longer than this many tokens prefill chunk by chunk, each chunk reading the KV of the
    ones before it, interleaved with other prompts (vLLM's chunked prefill). Default: the token budget."""
    prefix_cache_bytes: int = 1 << 30
    """Host bytes of recently computed prefix KV kept for reuse (full blocks, hash-chained as the
    decode tier's prefix cache); a prompt whose prefix is held computes only the rest. 0: off."""
    kv_events_config: str | None = None
    """vLLM's flag: publish what the host prefix KV stores and evicts as KV events (medium "CPU"), a JSON object of
    vLLM's keys, e.g. '{"enable_kv_cache_events": true, "endpoint": "tcp://router:5557", "topic":
    "kv@{worker}@MODEL"}' ({worker}: this worker's address; keys: kvcache/kv_events_config.py). Default: off."""
    prefix_caching_hash_algo: PrefixCachingHashAlgo = DEFAULT_HASH_ALGO
    """vLLM's flag: how a prefix block's hash is computed, as vLLM computes it (sha256, sha256_cbor, xxhash,
    xxhash_cbor); the first block's parent derives from PYTHONHASHSEED (README "KV events")."""
    min_bucket: int = field(default=16, metadata=flag(cli=False))
    """Prompt lengths are padded to powers of two from this up, so XLA compiles few shapes."""
    weight_dtype: WeightDtype = "auto"
    """auto: the checkpoint's dtype (a bf16 checkpoint on the CPU backend: bf16 or fp32, as --prefill-matmul
    chooses); int8/fp8: weight-only, per-output-channel scales, quantized at load."""
    prefill_matmul: PrefillMatmul = "auto"
    """How the layers' matmuls compute on the CPU backend (prefill/matmul_choice.py): auto measures the paths that
    can serve the weights at start (cached per machine and model shape) and keeps the fastest exact-enough one;
    xla-fp32, xla-bf16 (XLA:CPU) or onednn-bf16 (oneDNN's bf16 linear through torch: AMX, AVX512-bf16) force one.
    A bf16 checkpoint may take any of them, an fp32 one computes in fp32. TPU/GPU: XLA in the weights' dtype."""
    prefill_attention: PrefillAttention = "auto"
    """Where attention runs beside --prefill-matmul onednn-bf16: auto measures XLA's blockwise attention against
    torch's flash attention on the host (host_attention.py) at start, cached with the matmul choice; xla or host
    force one. Other matmul paths, and soft-capped models (Gemma 2), keep XLA's."""
    max_model_len: int | None = None
    """Longest prompt + output served (vLLM's flag); at most the model's own. Default: the model's."""
    tensor_parallel_size: int | None = None
    """Devices the prefill model is sharded over (vLLM's flag): kv heads and MLP split Megatron-style
    (sharding.py; DeepSeek's latent attention: by query heads, the latent whole on each device). Default: all the
    backend's devices, or the most of them that divide the model's kv heads (DeepSeek: query heads)."""
    expert_parallel_size: int = 1
    """A mixture-of-experts model's experts split over this many times the tensor-parallel devices (a mesh of
    ep x tp, sharding.py): each device holds num_experts / (ep x tp) whole experts, the attention and dense
    weights split over tp as without it (and replicated over ep). vLLM's --enable-expert-parallel takes
    EP = TP x DP; pdserve has no data-parallel axis, so the size is given. 1: the experts split over tp."""
    compilation_cache: str | Path = field(default="auto", metadata=flag("--compilation-cache", "--compile-cache-dir"))
    """JAX's persistent compilation cache, in which a restart (or a replacement worker, or every worker of a
    deployment given one directory on a shared filesystem) finds the compiles instead of redoing them, so it
    starts warm: auto: $JAX_COMPILATION_CACHE_DIR when set, else the machine's ($PDSERVE_CACHE/jax-compilation-cache,
    ~/.cache/pdserve by default); a directory; none: off."""
    executable_cache: bool = True
    """Keep the compiled programs' executables in --compilation-cache's directory (pdserve-executables/), keyed
    by what their tracing depends on (server/prefill/executables.py), so a restart loads them without tracing
    the model again; off with --no-executable-cache or PDSERVE_EXECUTABLE_CACHE=0, and with --compilation-cache
    none. The oneDNN matmul path and slices of several processes compile as before."""
    compile_before_serving: CompileBeforeServing = "common"
    """What compiles before the worker serves: common: what serves any prompt (every step shape without
    context, one with the largest context, sampling, penalized sampling at its largest shape); the rest
    compile on one thread while it serves, most asked for first, and meanwhile steps pack into the shapes
    compiled (a long prompt in more chunks): no request waits for a compile; all: every shape (a slice of
    several processes always does)."""
    coordinator_address: str | None = None
    """Multi-host slices: host:port of process 0's jax.distributed coordinator (or JAX_COORDINATOR_ADDRESS);
    every host runs this worker with the same flags: process 0 serves, the others replay its steps
    (replay.py). Unset: one host."""
    num_processes: int | None = None
    """Multi-host slices: processes in the slice (auto-detected on TPU slices when unset)."""
    process_id: int | None = None
    """Multi-host slices: this process's index, 0 .. num_processes - 1 (auto-detected on TPU slices)."""
    served_model_name: tuple[str, ...] = ()
    """The model's names (vLLM's flag); the first labels the metrics. Default: the checkpoint directory's name."""
    kv_layer_groups: int = 4
    """The prefill runs as this many layer groups; each group's KV leaves while the next computes."""
    kv_streams: int = 1
    """Parallel PushKv streams (each its own connection) per transfer."""
    max_pushes: int = 64
    """KV pushes in flight at once; at the bound the worker takes no new prompt until one ends."""
    max_push_bytes: int = 8 * 2**30
    """Host bytes of KV held by pushes in flight (same rule); a prompt whose KV alone exceeds it is refused."""
    prefill_order: PrefillOrder = "shortest-first"
    """Which queued prompt runs next (`--prefill-order`, scheduler.py): shortest-first keeps short prompts'
    TTFT from waiting behind long ones (benchmarks/load/prefill_overload.py); fifo: by arrival."""
    prefill_ageing: float = 32.0
    """shortest-first: a prompt of n tokens waits at most n / this seconds for prompts that arrive later
    (1536 tokens: 48 s). Faster ageing turns the order back into fifo once the backlog is longer than
    that: at 256 tokens/s (6 s), short prompts still waited a minute behind old long ones (prefill_overload)."""

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
    grammar_cache_bytes: int = 512 * 2**20
    """Compiled grammars cached, in (estimated) bytes; the least recently used are evicted past it."""

    def __post_init__(self) -> None:
        check_grammar_settings(self)
        if self.max_batch_size <= 0:
            raise ValueError(f"--max-batch-size must be >= 1, got {self.max_batch_size}")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"--weight-dtype must be one of {', '.join(WEIGHT_DTYPES)}, not {self.weight_dtype!r}")
        if self.prefill_matmul not in PREFILL_MATMULS:
            raise ValueError(f"--prefill-matmul must be one of {', '.join(PREFILL_MATMULS)}, not {self.prefill_matmul!r}")
        if self.prefill_attention not in PREFILL_ATTENTIONS:
            raise ValueError(f"--prefill-attention must be one of {', '.join(PREFILL_ATTENTIONS)}, not "
                             f"{self.prefill_attention!r}")
        if self.prefill_matmul != "auto" and self.weight_dtype in ("int8", "fp8"):
            raise ValueError(f"--prefill-matmul {self.prefill_matmul} chooses unquantized weights' matmuls; "
                             f"--weight-dtype {self.weight_dtype} has its own: drop one of the two flags")
        if self.compile_before_serving not in COMPILE_BEFORE_SERVING:
            raise ValueError(f"--compile-before-serving must be one of {', '.join(COMPILE_BEFORE_SERVING)}, "
                             f"not {self.compile_before_serving!r}")
        if self.prefill_order not in PREFILL_ORDERS:
            raise ValueError(f"--prefill-order must be one of {', '.join(PREFILL_ORDERS)}, not {self.prefill_order!r}")
        if not self.prefill_ageing > 0:
            raise ValueError(f"--prefill-ageing must be > 0 tokens/s, got {self.prefill_ageing}")
        if self.min_bucket <= 0 or self.min_bucket & (self.min_bucket - 1):
            raise ValueError(f"--min-bucket must be a power of two, got {self.min_bucket}")
        for name, value in (("--kv-layer-groups", self.kv_layer_groups), ("--kv-streams", self.kv_streams),
                            ("--max-pushes", self.max_pushes), ("--max-push-bytes", self.max_push_bytes)):
            if value <= 0:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.max_prefill_chunk is not None and self.max_prefill_chunk <= 0:
            raise ValueError(f"--max-prefill-chunk must be >= 1 token, got {self.max_prefill_chunk}")
        parse_kv_events_config(self.kv_events_config)
        BlockHasher(self.prefix_caching_hash_algo)  # refuses an unknown algorithm, or xxhash without the package
        if self.prefix_cache_bytes < 0:
            raise ValueError(f"--prefix-cache-bytes must be >= 0 (0 turns it off), got {self.prefix_cache_bytes}")
        self.check_offloading()
        self.check_lora()
        if self.enable_lora and (self.num_processes or 1) > 1:
            raise ValueError("--enable-lora is served by a prefill worker of one process so far (a slice of several "
                             "processes would need every process to load each adapter); drop --num-processes or "
                             "--enable-lora")
        if self.max_batch_tokens < self.min_bucket:
            raise ValueError(f"--max-num-batched-tokens must be >= {self.min_bucket}, got {self.max_batch_tokens}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"--max-model-len must be >= 1, got {self.max_model_len}")
        if self.tensor_parallel_size is not None and self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if self.expert_parallel_size < 1:
            raise ValueError(f"--expert-parallel-size must be >= 1, got {self.expert_parallel_size}")
        if self.num_processes is not None and self.num_processes < 1:
            raise ValueError(f"--num-processes must be >= 1, got {self.num_processes}")
        if self.process_id is not None and not 0 <= self.process_id < (self.num_processes or self.process_id + 1):
            raise ValueError(f"--process-id must lie in [0, --num-processes), got {self.process_id}")
        object.__setattr__(self, "served_model_name", tuple(self.served_model_name))

    @property
    def kv_events(self) -> KvEventsConfig | None:
        """--kv-events-config parsed (None: not given)."""
        return parse_kv_events_config(self.kv_events_config)

    @property
    def model_name(self) -> str:
        return self.served_model_name[0] if self.served_model_name else Path(self.model_dir).resolve().name
