"""Builds the vLLM decode engine (`pdserve decode --engine vllm`): vLLM's engine core in this process,
pdserve's connector, and with --tensor-parallel-size T > 1 vLLM's multiprocess executor running the model
in T rank processes (which read the received KV from shared memory: `staging.py`).

Runs in an environment with vLLM installed (`make vllm-venv`: .venv-vllm); the native engine's process
never imports vllm. On vLLM's CPU backend each rank binds its OpenMP threads to the cores
VLLM_CPU_OMP_THREADS_BIND names ("0|1": rank 0 on core 0, rank 1 on core 1); vLLM's default ("auto")
wants a NUMA node per rank, so with fewer nodes than ranks and the variable unset this worker splits its
cores among the ranks (`cpu_threads_bind`).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from pdserve.kvcache.layout import QUANTIZED, KvLayout
from pdserve.server.sampling_rules import repetition_penalty_of, top_p_of
from pdserve.server.decode.config import DecodeConfig
from pdserve.server.decode.sequence import Sequence
from pdserve.server.decode.spec.config import SpeculativeConfig
from pdserve.server.decode.vllm.cache_groups import CacheGroups
from pdserve.server.decode.vllm.engine import VllmEngine
from pdserve.server.decode.vllm.staging import KvStaging
from pdserve.server.kv_events_source import EventStream
from pdserve.server.model.config import ModelConfig, load_config, resolve_max_model_len
from pdserve.server.structured.grammars import Grammars

log = logging.getLogger("pdserve.decode.vllm")

CONNECTOR = "PdserveConnector"
CONNECTOR_MODULE = "pdserve.server.decode.vllm.connector"
GRAMMAR_PROCESSOR = "pdserve.server.decode.vllm.grammar_processor:GrammarProcessor"


def check_supported(config: DecodeConfig) -> None:
    """Refuses what the vLLM engine does not take from pdserve, naming both formats."""
    if config.kv_dtype in QUANTIZED:
        raise ValueError(
            f"--engine vllm cannot take --kv-dtype {config.kv_dtype}: pdserve's wire carries a float32 scale per "
            "block per kv head, vLLM's quantized cache one k_scale/v_scale per layer, and re-quantizing would "
            "lose the per-block range; use --kv-dtype auto, float32, bfloat16 or float16 with --engine vllm, "
            f"or --engine native for {config.kv_dtype}"
        )
    if config.weight_dtype in ("int8", "fp8"):
        raise ValueError(
            f"--engine vllm does not take --weight-dtype {config.weight_dtype}: serve a checkpoint vLLM "
            "quantizes itself, or use --engine native for pdserve's weight-only quantization"
        )


def sampling_params(seq: Sequence, num_prompt_tokens: int):
    """vLLM's SamplingParams for what is left of the request; pdserve's stop rules stay authoritative."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from pdserve.server.decode.vllm import grammar_processor

    p = seq.sampling
    stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(seq.eos_ids))
    structured = p.structured if p.structured.WhichOneof("kind") else None
    return SamplingParams(
        max_tokens=max(1, p.max_tokens - seq.sample_index),
        temperature=p.temperature,
        top_p=top_p_of(p),
        top_k=p.top_k,
        seed=p.seed if p.HasField("seed") else None,
        min_p=p.min_p,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=repetition_penalty_of(p),
        min_tokens=max(0, p.min_tokens - seq.sample_index),
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        ignore_eos=True,
        stop_token_ids=sorted(stop_ids),
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
        # the grammar, with the outputs vLLM's prompt ends with (pdserve's, sampled before vLLM's first)
        extra_args=None if structured is None else grammar_processor.extra_args(structured, seq.sample_index),
    )


SPEC_NO_GRAMMARS = ("this decode worker runs vLLM's own speculative decoding (--speculative-config), beside which "
                    "vLLM 0.32 refuses custom logits processors such as pdserve's grammar processor (\"Custom logits "
                    "processors are not supported when speculative decoding is enabled.\"); send structured "
                    "requests to a decode worker without --speculative-config, or use --engine native")


def vllm_speculative_config(spec: SpeculativeConfig) -> dict:
    """vLLM's speculative_config for pdserve's parsed one (the same keys: vLLM's own speculation runs it)."""
    return {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens,
            "prompt_lookup_min": spec.prompt_lookup_min, "prompt_lookup_max": spec.prompt_lookup_max}


def cpu_threads_bind(cores: list[int], num_numa_nodes: int, tp: int) -> str | None:
    """VLLM_CPU_OMP_THREADS_BIND for `tp` CPU ranks: None where vLLM's "auto" works (a NUMA node per rank),
    else the cores split in `tp` contiguous runs ("0,1|2,3"); refuses fewer cores than ranks."""
    if tp <= num_numa_nodes:
        return None
    if len(cores) < tp:
        raise ValueError(f"--tensor-parallel-size {tp} on the CPU needs a core per rank; this worker may use "
                         f"{len(cores)} ({cores}): lower --tensor-parallel-size or give it more cores")
    per_rank = len(cores) // tp
    return "|".join(",".join(map(str, cores[r * per_rank:(r + 1) * per_rank])) for r in range(tp))


def _bind_cpu_ranks(tp: int) -> None:
    if tp == 1 or os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "auto":
        return
    nodes = len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) or 1
    bind = cpu_threads_bind(sorted(os.sched_getaffinity(0)), nodes, tp)
    if bind is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
        log.info("VLLM_CPU_OMP_THREADS_BIND=%s: %d ranks over %d NUMA node(s)", bind, tp, nodes)


def vllm_kv_events_config(config: DecodeConfig, address: str):
    """vLLM's KVEventsConfig for pdserve's --kv-events-config (its topic's `{worker}` this worker's address, as
    pdserve's own publisher names it), or None when events are off."""
    from vllm.config import KVEventsConfig

    events = config.kv_events
    if events is None or not events.enabled:
        return None
    return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=events.endpoint,
                          replay_endpoint=events.replay_endpoint, buffer_steps=events.buffer_steps, hwm=events.hwm,
                          max_queue_size=events.max_queue_size, topic=events.topic_for(address))


def build_vllm_engine(config: DecodeConfig, address: str = "") -> tuple[ModelConfig, VllmEngine, KvLayout]:
    """address: this worker's advertised address (the `{worker}` in --kv-events-config's topic)."""
    check_supported(config)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core here: the connector meets our receiver
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.engine.llm_engine import LLMEngine

    from pdserve.server.decode.vllm import connector as vllm_connector
    from pdserve.server.decode.vllm.spec_stats import SpecDecodeStats

    model_config = load_config(config.model_dir).limited_to(config.max_model_len)
    from pdserve.server.preflight import check_vllm_model

    check_vllm_model(model_config)  # (PreflightError, a ValueError: the worker's start refuses it)
    dtype = model_config.dtype if config.kv_dtype == "auto" else config.kv_dtype
    # vLLM refuses a cache that cannot hold one request of max_model_len: cap it at the cache's tokens
    # (less vLLM's null block)
    num_blocks = config.num_blocks or -(-16384 // config.block_size)  # vLLM's cache: --kv-cache-tokens, else 16k
    max_model_len = resolve_max_model_len(model_config.max_model_len, config.max_model_len or 0,
                                          capacity=(num_blocks - 1) * config.block_size)
    tp = config.tensor_parallel_size
    spec = config.speculative
    if current_platform.is_cpu():
        _bind_cpu_ranks(tp)
    t0 = time.perf_counter()
    # KV events: vLLM's block pool publishes what its prefix cache stores and evicts, so the cache is on with them
    # (the connector then writes only the prompt's blocks vLLM does not hold already)
    kv_events = vllm_kv_events_config(config, address)
    args = EngineArgs(
        model=str(config.model_dir),
        dtype=dtype,
        block_size=config.block_size,
        num_gpu_blocks_override=num_blocks,
        max_num_seqs=config.max_running,
        max_model_len=max_model_len,
        enable_prefix_caching=kv_events is not None and config.enable_prefix_caching,
        prefix_caching_hash_algo=config.prefix_caching_hash_algo,
        kv_events_config=kv_events,
        skip_tokenizer_init=True,
        enforce_eager=True,  # no CUDA graphs / compile: starts ~60 s sooner; see README for GPU pools
        async_scheduling=False,
        tensor_parallel_size=tp,
        # T > 1: T rank processes, their inputs broadcast through shared memory; the engine core stays here
        **({"distributed_executor_backend": "mp"} if tp > 1 else {}),
        # On CPU this fraction of host memory is reserved up front; the cache is --kv-cache-tokens anyway.
        **({"gpu_memory_utilization": 0.1} if current_platform.is_cpu() else
           {"gpu_memory_utilization": config.gpu_memory_utilization} if config.gpu_memory_utilization else {}),
        # vLLM's stats only for its speculation's counters (`spec_stats.py`), which its scheduler counts then
        disable_log_stats=spec is None,
        **({} if spec is None else {"speculative_config": vllm_speculative_config(spec)}),
        # structured output: pdserve's grammars in vLLM's sampler (which vLLM 0.32 refuses beside its speculation)
        logits_processors=[] if spec is not None else [GRAMMAR_PROCESSOR],
        kv_transfer_config=KVTransferConfig(
            kv_connector=CONNECTOR, kv_connector_module_path=CONNECTOR_MODULE, kv_role="kv_consumer"
        ),
    )
    llm = LLMEngine.from_engine_args(args, stat_loggers=None if spec is None else [SpecDecodeStats])
    scheduler = llm.engine_core.engine_core.scheduler
    block_pool = scheduler.kv_cache_manager.block_pool
    num_total = block_pool.num_gpu_blocks - 1  # vLLM keeps block 0 as its null block
    layout = KvLayout.for_model(model_config, scheduler.block_size, dtype)
    groups = CacheGroups.of(scheduler.kv_cache_config, model_config.num_layers, scheduler.block_size)
    groups.check_windows(layout.windows, layout.num_layers)
    engine = VllmEngine(llm, model_config, layout, config.max_running, block_pool.get_num_free_blocks, num_total,
                        sampling_params, vllm_connector.STAGED, vllm_connector.PARAMS_KEY,
                        blocks_for=groups.blocks_for, grammar_refusal=None if spec is None else SPEC_NO_GRAMMARS,
                        eos_ids=frozenset(model_config.eos_token_ids), max_model_len=max_model_len,
                        staging=KvStaging(shared=tp > 1),
                        grammars=Grammars.for_model(config.model_dir, model_config.vocab_size,
                                                    tuple(model_config.eos_token_ids), **Grammars.options(config)))
    if kv_events is not None:
        published = scheduler.get_kv_event_publisher_config()  # a bound port of 0 resolved
        engine.kv_event_stream = EventStream(published.endpoint, published.replay_endpoint, published.topic.encode())
        log.info("KV events: vLLM publishes on %s (topic %r%s)%s", published.endpoint, published.topic,
                 f", replay on {published.replay_endpoint}" if published.replay_endpoint else "",
                 "" if config.enable_prefix_caching else "; --no-enable-prefix-caching: vLLM's cache stores nothing")
    if engine.grammars is not None:
        engine.grammars.warm()
    log.info("vLLM decode engine for %s ready in %.1f s: %d KV blocks x %d tokens (%s), tensor parallel %d, "
             "%d KV cache group(s)%s", model_config.describe(), time.perf_counter() - t0, num_total,
             layout.block_size, dtype, tp, len(groups.block_sizes),
             f" (layer windows {','.join(map(str, groups.layer_windows))})" if layout.windows else "")
    if spec is not None:
        log.info("speculative decoding by vLLM's own %s proposer: up to %d tokens a step (n-grams of %d..%d)",
                 spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    from pdserve.server import hardware

    engine.hardware = hardware.Hardware(cpu=hardware.cpu(), torch=hardware.torch_probe(),
                                        device="cpu" if current_platform.is_cpu() else "cuda:0",
                                        paths={"matmuls": f"vLLM {vllm_version()} ({dtype})"})
    log.info("decode hardware: %s", engine.hardware.describe())
    return model_config, engine, layout


def vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for name in ("vllm", "vllm-cpu"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "?"
