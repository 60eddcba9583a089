"""The native decode engine as a worker starts it: the model on its device, the KV cache sized, the
decode step eager or CUDA-graphed. `benchmarks/gpu.py` starts it the same way (`engine_for_model`).

1. `--device` resolved (auto: CUDA when torch sees one).
2. The model built from its config on the device, the checkpoint's tensors loaded, then quantized when
   --weight-dtype is int8/fp8 (through a kernel for the format where the device has one); on the CPU a
   bf16/fp16 checkpoint computes as `cpu_matmul` chooses from what the CPU runs (`hardware.py`): prepacked
   for oneDNN, torch's default linear, or upcast to fp32 (`prepare`), and a mixture of experts' step through
   the fused C kernel, torch's grouped matmul or the loop over chosen experts, measured
   (`cpu_moe`). One start-up line names them.
3. The KV layout; the cache's blocks from --kv-cache-tokens, else from memory (`device.py`).
4. The engine: cache on the device, CUDA graphs captured per batch bucket (and with speculative decoding per
   (bucket, new tokens) for the verify step) unless --enforce-eager; on CUDA a mixture of experts through the
   fused Triton kernels (`cuda_moe`) where its probe passes. With draft_model speculation the draft is loaded
   beside the model (same device and compute dtype, eager steps), and every block of the budget pays for the
   target's KV and the draft's at that block id (`spec/draft.py`).
"""

from __future__ import annotations

import logging
import time

import torch

from pdserve.kvcache.block_hash import BlockHasher
from pdserve.kvcache.kv_events import MEDIUM_GPU, KvEventRecorder
from pdserve.kvcache.layout import KvLayout
from pdserve.kvcache.tiered_store import TieredStore
from pdserve.server import hardware, metrics
from pdserve.server.decode import cpu_matmul, cpu_moe, cuda_mla, cuda_moe
from pdserve.server.decode.config import DecodeConfig
from pdserve.server.decode.cuda_attention import have_triton
from pdserve.server.decode.device import (DEFAULT_GPU_MEMORY_UTILIZATION, cpu_cache_blocks, gpu_cache_blocks,
                                          parse_bytes, profile_step, resolve_device)
from pdserve.server.decode.engine import DecodeEngine
from pdserve.server.decode.kv_cache import QUANTIZED_TORCH_DTYPES, TORCH_DTYPES, PagedKvCache
from pdserve.server.decode.lora import LoraSlots
from pdserve.server.decode.model import DecoderModel
from pdserve.server.decode.model_runner import CudaGraphRunner
from pdserve.server.decode.quant import QUANTIZED_WEIGHTS, Linear, buffer_bytes
from pdserve.server.decode.spec.draft import draft_layout
from pdserve.server.decode.weights import build_model
from pdserve.server.kv_offloading import open_offload
from pdserve.server.model.config import ModelConfig, load_config
from pdserve.server.model.fingerprint import fingerprint
from pdserve.server.model.fp8_checkpoint import load_note
from pdserve.server.model.weights import load_weights
from pdserve.server.structured.grammars import Grammars

log = logging.getLogger("pdserve.decode")


def dtypes(config: DecodeConfig, model_config: ModelConfig) -> tuple[str, str]:
    """(weight dtype, compute dtype) the flags and the checkpoint give, before the CPU's choice (the KV
    dtype follows the compute dtype the model ends up with: `engine_for_model`)."""
    weight_dtype = model_config.dtype if config.weight_dtype == "auto" else config.weight_dtype
    quantized = weight_dtype in QUANTIZED_WEIGHTS
    compute_dtype = (model_config.dtype if model_config.dtype in TORCH_DTYPES else "float32") if quantized \
        else weight_dtype
    return weight_dtype, compute_dtype


def cpu_path(config: DecodeConfig, model_config: ModelConfig, compute_dtype: str, quantized: bool,
             device: torch.device) -> tuple[str | None, str]:
    """On the CPU: (`cpu_matmul` path, its start-up words); elsewhere (None, "")."""
    if device.type != "cpu":
        return None, ""
    dtype = TORCH_DTYPES[compute_dtype]
    path, why = cpu_matmul.choose(config.cpu_matmul, dtype, hardware.cpu(), hardware.torch_probe(),
                                  model_config.hidden_size, model_config.intermediate_size, quantized)
    return path, cpu_matmul.describe(path, dtype, why)


def build_native_engine(config: DecodeConfig) -> tuple[ModelConfig, DecodeEngine, KvLayout]:
    model_config = load_config(config.model_dir).limited_to(config.max_model_len)
    device = resolve_device(config.device)
    if config.gpu_memory_utilization is not None and device.type != "cuda":
        log.warning("--gpu-memory-utilization %s does not apply: this decode worker computes on the CPU; its KV "
                    "cache is sized by --kv-cache-tokens or --kv-cache-memory", config.gpu_memory_utilization)
    weight_dtype, compute_dtype = dtypes(config, model_config)
    if config.threads:
        torch.set_num_threads(config.threads)
    quantized = weight_dtype in QUANTIZED_WEIGHTS
    path, matmuls = cpu_path(config, model_config, compute_dtype, quantized, device)
    if path in cpu_matmul.UPCAST:
        compute_dtype = "float32"
    paths = {"matmuls": matmuls} if matmuls else {}
    found = hardware.Hardware(cpu=hardware.cpu(), torch=hardware.torch_probe(), device=str(device), paths=paths)
    log.info("decode hardware: %s", found.describe())
    t0 = time.perf_counter()
    if note := load_note(config.model_dir, "decode", compute_dtype, device.type):
        log.info("%s", note)
    model = build_model(model_config, load_weights(config.model_dir), dtype=TORCH_DTYPES[compute_dtype],
                        weight_format=weight_dtype if quantized else None, device=device)
    prepared = prepare(model, path)
    if quantized:
        paths["weights"] = model.weight_kernel
    log.info("decode model %s loaded onto %s in %.1f s; weights %.1f MiB (%s, compute %s)%s%s",
             model_config.describe(), device, time.perf_counter() - t0, buffer_bytes(model) / 2**20, weight_dtype,
             compute_dtype, f"; {model.weight_kernel}" if quantized else "", f"; {prepared}" if prepared else "")
    draft = build_draft(config, model_config, device, TORCH_DTYPES[compute_dtype], path)
    engine, layout = engine_for_model(config, model, draft)
    engine.hardware = found
    return model_config, engine, layout


def build_draft(config: DecodeConfig, model_config: ModelConfig, device: torch.device, dtype: torch.dtype,
                path: str | None) -> DecoderModel | None:
    """draft_model speculation's draft (checked against the model by DecodeConfig), on the device, computing in the
    model's compute dtype as the model's CPU path does; None without it."""
    spec = config.speculative
    if spec is None or spec.method != "draft_model":
        return None
    t0 = time.perf_counter()
    draft_config = load_config(spec.model).limited_to(model_config.max_model_len)
    draft = build_model(draft_config, load_weights(spec.model), dtype=dtype, device=device)
    prepared = prepare(draft, path)
    log.info("draft model %s (%s) loaded onto %s in %.1f s; weights %.1f MiB%s", draft_config.describe(), spec.model,
             device, time.perf_counter() - t0, buffer_bytes(draft) / 2**20, f"; {prepared}" if prepared else "")
    return draft


def prepare(model: DecoderModel, path: str | None) -> str:
    """The load-time steps once the weights (and their quantization) are in, where the model runs: on the
    CPU, a mixture of experts' step measured (`cpu_moe.prepare`: the fused C kernel, torch's grouped matmul or the
    loop over chosen experts), then with a prepacked path (`cpu_matmul.PACKED`) the linears prepacked for oneDNN
    (the experts too where the loop was kept); nothing otherwise
    (CUDA included). Returns what it did, for the start-up log."""
    done = []
    moe = ""
    if path is not None and model.config.moe is not None:  # first: a path reading plain experts keeps them plain
        moe = f"mixture of experts on cpu: {cpu_moe.prepare(model, prepack=path in cpu_matmul.PACKED)}"
    if path in cpu_matmul.PACKED:
        model.prepack(float32=True)
        packed = sum(isinstance(m, Linear) and m.packed for m in model.modules())
        if packed:
            done.append(f"{packed} matmul weights prepacked for oneDNN (the LM head's among them)")
    if moe:
        done.append(moe)
    return "; ".join(done)


def engine_for_model(config: DecodeConfig, model: DecoderModel, draft: DecoderModel | None = None
                     ) -> tuple[DecodeEngine, KvLayout]:
    """The engine over a model (and draft_model's draft) already on its device (steps 3 and 4)."""
    model_config = model.config
    device = model.embed.device
    compute_dtype = str(model.dtype).removeprefix("torch.")
    kv_dtype = compute_dtype if config.kv_dtype == "auto" else config.kv_dtype  # auto: the model's compute dtype
    model.paged_kernel = device.type == "cuda" and have_triton()
    if model.paged_kernel and model_config.mla is not None:
        kv_torch = (TORCH_DTYPES | QUANTIZED_TORCH_DTYPES)[kv_dtype]
        mla = model_config.mla
        if why := cuda_mla.self_check(model_config.num_heads, mla.kv_lora_rank, mla.qk_rope_head_dim,
                                      config.block_size, model.dtype, kv_torch, device):
            log.warning("%s: latent attention decodes through the reference path (gathered blocks)", why)
            model.paged_kernel = False
        else:
            log.info("latent attention decodes through the MLA Triton kernel (cuda_mla), checked on this shape")
    if draft is not None:
        draft.paged_kernel = model.paged_kernel
    if device.type == "cuda" and not model.paged_kernel:
        log.warning("triton is not installed: decode attention on %s gathers whole block tables (pip install "
                    "triton for the paged kernel)", device)
    if device.type == "cuda" and model_config.moe is not None:
        fuse_experts(model, device)
    layout = KvLayout.for_model(model_config, config.block_size, kv_dtype)
    cuda_graphs = device.type == "cuda" and not config.enforce_eager
    if cuda_graphs and model_config.moe is not None:  # the grouped expert step reads its routing on the host
        log.warning("%s: a mixture-of-experts model decodes in eager steps on %s (no CUDA graphs)",
                    model_config.describe(), device)
        cuda_graphs = False
    draft_bytes = 0 if draft is None else PagedKvCache.bytes_per_block(draft_layout(draft, config.block_size))
    num_blocks, sized_by = cache_blocks(config, model, layout, device, cuda_graphs, draft_bytes)
    t0 = time.perf_counter()
    kv_events = KvEventRecorder(MEDIUM_GPU) if config.kv_events and config.kv_events.enabled else None
    offload = decode_offload(config, model_config, layout, kv_events, draft is not None)
    engine = DecodeEngine(model, layout, num_blocks, config.max_running, max_queue=config.max_queue,
                          enable_prefix_caching=config.enable_prefix_caching,
                          eos_ids=frozenset(model_config.eos_token_ids), max_model_len=config.max_model_len or 0,
                          cuda_graphs=cuda_graphs, speculative=config.speculative, draft_model=draft,
                          hasher=BlockHasher(config.prefix_caching_hash_algo), kv_events=kv_events, offload=offload,
                          lora=lora_slots(config, model), idle_prefill_threads=config.threads_while_prefill_idle,
                          grammars=Grammars.for_model(config.model_dir, model_config.vocab_size,
                                                      tuple(model_config.eos_token_ids), **Grammars.options(config)))
    if engine.grammars is not None:
        engine.grammars.warm()
    log.info("decode KV cache on %s: %d blocks x %d tokens = %d tokens (%s, %.1f MiB incl. scales; %s); %s",
             device, num_blocks, config.block_size, num_blocks * config.block_size, kv_dtype,
             engine.cache.nbytes / 2**20, sized_by,
             f"CUDA graphs for batches {', '.join(map(str, engine.runner.buckets))} captured in "
             f"{time.perf_counter() - t0:.1f} s" if isinstance(engine.runner, CudaGraphRunner) else "eager steps")
    if config.speculative is not None:
        spec = config.speculative
        runner = engine.runner
        verify = "the paged kernel" if model.paged_kernel else "the reference attention"
        if isinstance(runner, CudaGraphRunner):
            verify += f", CUDA graphs for {len(runner.verify_graphs)} (batch, new tokens) shapes"
        how = f"n-grams of {spec.prompt_lookup_min}..{spec.prompt_lookup_max}" if spec.method == "ngram" else \
            f"drafted by {spec.model} in {spec.num_speculative_tokens} batched steps, its KV {draft_bytes} bytes " \
            f"a block"
        log.info("speculative decoding: %s, up to %d proposed tokens a step (%s), verified in one step (%s); cap "
                 "from measured step costs%s", spec.method, spec.num_speculative_tokens, how, verify,
                 f", off at batch >= {spec.disable_by_batch_size}" if spec.disable_by_batch_size else "")
    return engine, layout


def decode_offload(config: DecodeConfig, model_config: ModelConfig, layout: KvLayout,
                   kv_events: KvEventRecorder | None, drafting: bool) -> TieredStore | None:
    """The offload tiers under the prefix cache (--kv-offloading-*), or None; logged in one line."""
    if not config.offloading:
        return None
    if drafting or not config.enable_prefix_caching or layout.blocks_behind_windows(1 << 62) or layout.latent:
        why = ("a draft model's KV is not offloaded" if drafting else "--no-enable-prefix-caching" if not
               config.enable_prefix_caching else "MLA latents are not offloaded yet (issue 42)" if layout.latent
               else "every layer is windowed")
        log.warning("--kv-offloading-*: off on this decode worker (%s)", why)
        return None
    store = open_offload(config, layout, fingerprint(config.model_dir, model_config), kv_events)
    metrics.watch_kv_offload(lambda: (store.stats(), store.save_drops))
    log.info("KV offload tiers under the decode prefix cache: %s", store.describe())
    return store


def fuse_experts(model: DecoderModel, device: torch.device) -> None:
    """On CUDA, the experts' step through the fused Triton kernels (`cuda_moe`) where they run for the model's
    weight format and compute dtype (tried once on a small MoE); else the grouped loop, said in one line."""
    fmt = model.weight_format
    ok, why = cuda_moe.runs(fmt, model.dtype, device) if have_triton() else (False, "triton is not installed")
    if not ok:
        log.warning("mixture of experts on %s: the grouped loop (one matmul pair per chosen expert, routing read on "
                    "the host): the fused Triton kernels do not run for %s weights computing in %s (%s)", device,
                    fmt or "unquantized", model.dtype, why)
        return
    layers = model.fuse_experts()
    log.info("mixture of experts on %s: %d layers through the fused Triton kernels (%s weights, %s)", device, layers,
             fmt or "unquantized", why)


def cache_blocks(config: DecodeConfig, model: DecoderModel, layout: KvLayout, device: torch.device,
                 cuda_graphs: bool, draft_bytes: int = 0) -> tuple[int, str]:
    """The KV cache's blocks and what sized it: --kv-cache-tokens, else the memory left on the device (each
    block costing its KV and draft_bytes, a draft model's KV at the same block id)."""
    if config.num_blocks is not None:
        return config.num_blocks, f"--kv-cache-tokens {config.kv_cache_tokens}"
    max_model_len = model.config.max_model_len
    if device.type != "cuda":
        budget = parse_bytes(config.kv_cache_memory, "--kv-cache-memory")
        blocks = cpu_cache_blocks(budget, layout, config.max_running, max_model_len, draft_bytes)
        return blocks, f"--kv-cache-memory {config.kv_cache_memory}, at most --max-running x --max-model-len"
    utilization = config.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION
    peak, other, total = profile_step(model, layout, config.max_running, max_model_len, device)
    # the pad block CUDA graphs' and verify steps' pad rows write, the null block of a windowed model's dropped blocks
    pad = 1 if cuda_graphs or config.speculative or layout.blocks_behind_windows(1 << 62) else 0
    blocks = gpu_cache_blocks(total, utilization, peak, other, layout, reserved_blocks=pad,
                              extra_block_bytes=draft_bytes)
    return blocks, (f"--gpu-memory-utilization {utilization} of {total / 2**30:.1f} GiB; weights + a step at batch "
                    f"{config.max_running} peaked at {peak / 2**30:.2f} GiB, other memory {other / 2**30:.2f} GiB")


def lora_slots(config: DecodeConfig, model: DecoderModel) -> LoraSlots | None:
    """The LoRA adapters' device slots and host LRU under --enable-lora (None without it)."""
    if not config.enable_lora:
        return None
    if model.config.mla is not None:
        raise ValueError(f"--enable-lora: LoRA adapters are not served for {model.config.family} (latent attention) "
                         "models yet; serve it without --enable-lora")
    dtype = model.dtype if config.lora_dtype == "auto" else getattr(torch, config.lora_dtype)
    slots = LoraSlots(model.config, config.max_loras, config.cpu_loras, config.max_lora_rank, dtype,
                      model.embed.device)
    log.info("LoRA: %d device slots (--max-loras), %d adapters in host memory (--max-cpu-loras), rank <= %d, %s; "
             "steps with adapters run eagerly; deltas by %s (%s)", config.max_loras, config.cpu_loras,
             config.max_lora_rank, str(dtype).removeprefix("torch."),
             "the Triton BGMV kernels" if slots.kernel else "gathered bmm", slots.kernel_why)
    return slots
