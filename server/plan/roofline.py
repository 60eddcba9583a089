"""Profiles for hardware not measured here: a roofline model of each step, scaled by efficiency factors.

For an accelerator A (catalog.json) running a model M (its shape in the catalog) on `chips` chips with
weight dtype w and KV dtype k, with F = chips x A's peak FLOP/s at w x e_compute and
B = chips x A's HBM bytes/s x e_bandwidth:
- prefill step  = overhead_prefill + weights(w) / B + (2 x params / F) x padded tokens
                  + (4 x layers x hidden / F) x attention pairs
- decode step   = overhead_decode + weights(w) / B + (2 x params / F) x batch
                  + (kv_bytes(k) / B + 4 x layers x hidden / F) x context tokens
- KV handoff    = overhead_handoff + tokens x kv_bytes(k) / (the slower side's network bytes/s)
- KV cache      = (HBM x chips x 0.9 - weights) / kv_bytes(k) tokens.
Compute and memory times are added, not maxed: a bound within 2x of the roofline's max(), tight when one
of them dominates (decode: memory; long prefill: compute). Tensor parallelism is taken as linear (no
all-reduce time): a floor for multi-chip workers.

The efficiency factors come from a measured run (`efficiency_of`): the measured profile's per-token
prefill time against the measured machine's peak FLOP/s, its per-context-token decode time against its
peak bytes/s. On an accelerator those are the roofline's real factors. A CPU run of a model that fits in
the CPU's caches measures per-step overhead instead (factors far below 1%); projecting a GPU with them
would be wrong by orders of magnitude, so `DEFAULT` (0.5 of peak FLOP/s, 0.7 of HBM bandwidth, the
ranges published for vLLM/SGLang on H100) is used unless the measured profile is an accelerator's, and
the choice is printed. The overheads likewise: the measured ones when measured on an accelerator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.server.plan.catalog import Accelerator, Dtype, ModelShape
from pdserve.server.plan.profile import DecodeCost, HandoffCost, PrefillCost, Profile

HBM_USABLE = 0.9
"""Of the HBM, what weights + KV may take (activations, workspace, CUDA graphs take the rest)."""
WEIGHTS_SHARE = 0.6
"""A worker's chips: the fewest (a power of two) whose HBM holds the weights in at most this share."""
MAX_CHIPS = 8


class DoesNotFit(ValueError):
    """The model does not fit the accelerator at this dtype within MAX_CHIPS chips."""


@dataclass(frozen=True)
class Efficiency:
    compute: float
    """Achieved / peak FLOP/s."""
    bandwidth: float
    """Achieved / peak HBM bytes/s."""
    prefill_overhead_s: float = 0.002
    decode_overhead_s: float = 0.001
    handoff_overhead_s: float = 0.001
    ttft_overhead_s: float = 0.002
    source: str = "default"

    def __post_init__(self) -> None:
        for name in ("compute", "bandwidth"):
            v = getattr(self, name)
            if not (0 < v <= 1):
                raise ValueError(f"efficiency {name} must be in (0, 1], got {v}")


DEFAULT = Efficiency(0.5, 0.7)


def efficiency_of(profile: Profile) -> Efficiency | None:
    """The factors a measured profile implies, from its notes' `peak` (the measured machine's peak FLOP/s
    and bytes/s) and `model_shape`; None when it lacks them."""
    peak, shape = profile.notes.get("peak"), profile.notes.get("model_shape")
    if not peak or not shape or not profile.prefill.per_token_s or not profile.decode.per_context_token_s:
        return None
    compute = 2 * shape["params"] / profile.prefill.per_token_s / peak["flops"]
    bandwidth = profile.handoff.kv_bytes_per_token / profile.decode.per_context_token_s / peak["bytes_per_s"]
    return Efficiency(min(compute, 1.0), min(bandwidth, 1.0), profile.prefill.fixed_s, profile.decode.fixed_s,
                      profile.handoff.fixed_s, profile.ttft_overhead_s, source=f"measured on {profile.hardware}")


def chips_for(acc: Accelerator, model: ModelShape, weight_dtype: Dtype) -> int:
    weights = model.weight_bytes(weight_dtype)
    chips = 1
    while weights > WEIGHTS_SHARE * acc.hbm_bytes * chips:
        chips *= 2
        if chips > MAX_CHIPS:
            raise DoesNotFit(f"{model.name} ({weights / 1e9:.0f} GB of {weight_dtype} weights) does not fit "
                             f"{MAX_CHIPS} x {acc.name}")
    return chips


def project(acc: Accelerator, model: ModelShape, weight_dtype: Dtype, kv_dtype: Dtype, eff: Efficiency,
            chips: int | None = None) -> Profile:
    """The profile of one worker of `chips` (default: the fewest that hold the weights) x `acc`."""
    peak = acc.flops(weight_dtype)
    if peak is None:
        raise DoesNotFit(f"{acc.name} has no {weight_dtype} path (catalog: peak_tflops.{weight_dtype} is null)")
    chips = chips or chips_for(acc, model, weight_dtype)
    flops = peak * chips * eff.compute
    bw = acc.hbm_bytes_per_s * chips * eff.bandwidth
    weights = model.weight_bytes(weight_dtype)
    kv = model.kv_bytes_per_token(kv_dtype)
    kv_tokens = math.floor((HBM_USABLE * acc.hbm_bytes * chips - weights) / kv)
    if kv_tokens < 1:
        raise DoesNotFit(f"{chips} x {acc.name}: no room for KV beside {model.name}'s weights")
    per_token = 2 * model.params / flops
    attention = 4 * model.layers * model.hidden / flops
    return Profile(
        hardware=acc.name, model=model.name,
        prefill=PrefillCost(eff.prefill_overhead_s + weights / bw, per_token, attention),
        decode=DecodeCost(eff.decode_overhead_s + weights / bw, per_token, kv / bw + attention, per_token),
        handoff=HandoffCost(eff.handoff_overhead_s, acc.network_bytes_per_s * chips, int(kv)),
        kv_cache_tokens=kv_tokens, source="projected", ttft_overhead_s=eff.ttft_overhead_s, chips=chips,
        notes={"weight_dtype": weight_dtype, "kv_dtype": kv_dtype, "efficiency": eff.__dict__,
               "flops": flops, "bytes_per_s": bw})
