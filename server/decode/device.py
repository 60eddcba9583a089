"""Where the decode worker runs and how much memory its KV cache takes.

`--device auto|cpu|cuda[:N]` picks the device. Without `--kv-cache-tokens` the cache is sized from
memory: on CUDA as vLLM does, `--gpu-memory-utilization` of the device's memory less what the weights
and a profiling step at the largest batch took (and what other processes hold); on the CPU a byte budget,
`--kv-cache-memory`, capped at what `--max-running` requests of `--max-model-len` tokens can hold.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from pdserve.kvcache.layout import KvLayout

if TYPE_CHECKING:  # the flags are parsed where torch is absent (the coordinator's `pdserve up` parser)
    import torch

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
"""vLLM's default."""


def parse_device(device: str) -> str:
    """The flag's value checked: auto, cpu, cuda or cuda:N; ValueError saying what it takes."""
    if not _DEVICE.fullmatch(device):
        raise ValueError(f"--device takes auto, cpu, cuda or cuda:N, not {device!r}")
    return device


def resolve_device(device: str) -> torch.device:
    """auto: cuda (the current device) when torch sees one, else the CPU; cuda[:N] must exist."""
    import torch

    parse_device(device)
    if device == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: torch sees no CUDA device here (torch {torch.__version__}); "
                             f"run with --device cpu, or install a CUDA build of torch")
        resolved = torch.device(device if ":" in device else f"cuda:{torch.cuda.current_device()}")
        if resolved.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) here")
        return resolved
    return torch.device("cpu")


def parse_bytes(text: str, flag: str = "size") -> int:
    """'4GiB', '512MiB', '1.5g', '1000000' -> bytes; ValueError naming the flag and the forms it takes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"{flag} takes a positive size such as 4GiB, 512MiB or 1000000 (bytes), not {text!r}")
    return int(float(m.group(1)) * _UNITS[unit])


def bytes_per_block(layout: KvLayout) -> int:
    """K and V of one block over all layers, plus float32 scales per kv head when quantized."""
    from pdserve.server.decode.kv_cache import PagedKvCache

    return PagedKvCache.bytes_per_block(layout)


def cpu_cache_blocks(budget: int, layout: KvLayout, max_running: int, max_model_len: int,
                     extra_block_bytes: int = 0) -> int:
    """Blocks in `budget` bytes, no more than max_running sequences of max_model_len tokens can hold;
    extra_block_bytes: what each block costs beside the layout's (a draft model's KV at the same block id)."""
    useful = max_running * layout.num_blocks(max_model_len)
    per_block = bytes_per_block(layout) + extra_block_bytes
    blocks = min(budget // per_block, useful)
    if blocks < 1:
        raise ValueError(f"--kv-cache-memory {budget} bytes holds no {per_block}-byte block; "
                         f"give a larger budget or --kv-cache-tokens")
    return blocks


def gpu_cache_blocks(total: int, utilization: float, peak_torch: int, other: int, layout: KvLayout,
                     reserved_blocks: int = 0, extra_block_bytes: int = 0) -> int:
    """vLLM's rule: utilization x total device bytes, less the peak torch allocated for the weights and a
    profiling step (peak_torch) and what is held outside torch's allocator (other: CUDA context, NCCL,
    other processes), is the KV cache; in whole blocks, less reserved_blocks (the CUDA graphs' pad block)."""
    budget = int(total * utilization) - peak_torch - other
    blocks = budget // (bytes_per_block(layout) + extra_block_bytes) - reserved_blocks
    if blocks < 1:
        raise ValueError(
            f"--gpu-memory-utilization {utilization} of {total / 2**30:.1f} GiB leaves no KV cache: the weights and "
            f"a step at the largest batch take {peak_torch / 2**30:.1f} GiB, other memory {other / 2**30:.1f} GiB; "
            f"raise --gpu-memory-utilization, lower --max-running or --max-model-len, or quantize the weights")
    return blocks


PROFILE_PREFILL_TOKENS = 2048
"""The longest local prefill the profiling step runs (a prompt's logits are [S, V] float32)."""


def profile_step(model, layout: KvLayout, max_batch: int, max_model_len: int, device: torch.device
                 ) -> tuple[int, int, int]:
    """Runs a prefill of min(max_model_len, PROFILE_PREFILL_TOKENS) tokens and a decode step at the largest
    batch (padded to its CUDA-graph bucket) over a scratch cache. Returns (peak bytes torch allocated, less
    the scratch cache; bytes held outside torch's allocator; the device's total bytes)."""
    import torch

    from pdserve.server.decode.kv_cache import PagedKvCache
    from pdserve.server.decode.model_runner import bucket_for

    batch = bucket_for(max_batch) or max_batch
    prompt = min(max_model_len, PROFILE_PREFILL_TOKENS)
    num_blocks = max(batch, layout.num_blocks(prompt))
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    cache = PagedKvCache(layout, num_blocks, device=device)
    model.prefill(torch.zeros(prompt, dtype=torch.int64), list(range(layout.num_blocks(prompt))), cache)
    tables = (torch.arange(batch) % num_blocks)[:, None]  # [B, 1] a block each
    positions = torch.zeros(batch, dtype=torch.int64)
    model.decode(torch.zeros(batch, dtype=torch.int64), positions, tables, positions + 1, cache)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - cache.nbytes
    del cache
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    other = max(0, (total - free) - torch.cuda.memory_reserved(device))
    return peak, other, total
