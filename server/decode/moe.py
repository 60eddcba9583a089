"""The mixture-of-experts MLP of the decode tier (Mixtral, Qwen3-MoE, DeepSeek): one grouped expert step per forward.

The router picks each token's top k experts (softmax in fp32 over all of them, then the top k, renormalised
when the family does; DeepSeek-V3: sigmoid scores, chosen with a correction bias among the best groups of
experts, scaled by routed_scaling_factor). The batch's token copies are sorted by expert, and each expert the step chose runs
once over all its rows: its weights are read once per step, whatever the batch, and experts no token chose
are not read at all. Each expert is a pair of `Linear`s (gate|up fused, down), so int8/fp8 weights
(`quant.quantize`) and oneDNN prepacking apply to them as to the dense layers; the router stays in the
compute dtype. Which experts run is read on the host (one small copy a layer): this path is eager, not for
CUDA graphs.

On the CPU, `cpu_moe.prepare` measures at start-up which runs the same step fastest on the layer's weights: one
call of the fused C kernel over the experts' weights laid out in panels (`fuse_cpu`, `cpu_moe_kernel`: no Python
per expert), two calls of torch's grouped matmul (`group`, `cpu_moe.grouped_experts`), or the loop over
oneDNN-prepacked experts; the loop stays where the experts are quantized.

On CUDA (`fuse`, at start-up where the probe `cuda_moe.runs` passes) the same step is two fused Triton kernels
over the experts' weights stacked (`cuda_moe`): the copies sorted by expert on the device, a grouped matmul for
gate|up with the activation, the down projection and the weighted sum, with no host read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.server.decode.cpu_moe import activation, combine
from pdserve.server.decode.quant import Linear
from pdserve.server.model.config import MoeConfig


def route(logits: torch.Tensor, moe: MoeConfig, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights f32 [T, k], experts int64 [T, k]). bias [E] (DeepSeek-V3's correction
    bias) is added to the scores to choose the experts only; the weights are the scores themselves."""
    if moe.scoring == "softmax" and moe.num_groups == 1 and bias is None:
        weights, experts = logits.float().softmax(-1).topk(moe.top_k, dim=-1)
    else:
        scores = logits.float().softmax(-1) if moe.scoring == "softmax" else logits.float().sigmoid()  # [T, E]
        choice = scores if bias is None else scores + bias.float()
        if moe.num_groups > 1:
            choice = _in_best_groups(choice, moe)
        experts = choice.topk(moe.top_k, dim=-1)[1]  # [T, k]
        weights = scores.gather(1, experts)
    if moe.renormalize:
        # DeepSeek-V3 (sigmoid scores) guards the sum as transformers does; softmax's never needs it
        weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if moe.scoring == "sigmoid" else 0.0))
    if moe.routed_scale != 1.0:
        weights = weights * moe.routed_scale
    return weights, experts


def _in_best_groups(choice: torch.Tensor, moe: MoeConfig) -> torch.Tensor:
    """choice [T, E] with the experts outside each token's `topk_groups` best groups set to -inf; a group's
    score is its best expert's (V2) or the sum of its best two (V3)."""
    T, E = choice.shape
    grouped = choice.view(T, moe.num_groups, E // moe.num_groups)  # [T, G, E / G]
    group_scores = grouped.max(-1).values if moe.group_score == "max" else grouped.topk(2, dim=-1)[0].sum(-1)
    best = group_scores.topk(moe.topk_groups, dim=-1)[1]  # [T, topk_groups]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # [T, G]
    return grouped.masked_fill(~keep[..., None], float("-inf")).view(T, E)


class MoeMlp(nn.Module):
    def __init__(self, moe: MoeConfig, hidden: int, act: str, dtype: torch.dtype, device: torch.device | str | None):
        """Empty buffers of the experts' shapes; `weights.load_weights` fills them."""
        super().__init__()
        self.moe = moe
        self.act = act
        E, I = moe.num_experts, moe.intermediate_size
        self.router = nn.Buffer(torch.empty(E, hidden, dtype=dtype, device=device))  # [E, d]
        self.correction_bias = nn.Buffer(torch.empty(E, dtype=torch.float32, device=device)) \
            if moe.correction_bias else None  # [E] DeepSeek-V3's e_score_correction_bias (choice only)
        self.gate_up = nn.ModuleList(Linear(hidden, 2 * I, False, dtype, device) for _ in range(E))  # [2 I, d] each
        self.down = nn.ModuleList(Linear(I, hidden, False, dtype, device) for _ in range(E))  # [d, I] each
        self.fused = None
        """The experts' weights stacked for the fused CUDA kernels (`cuda_moe.StackedExperts`) once `fuse` ran;
        None: the grouped loop."""
        self.stacked = None
        """The experts' weights stacked (`cuda_moe.StackedExperts`) for the grouped matmul, once `group` ran (or
        `cpu_moe.measure`)."""
        self.grouped = False
        """The step through `cpu_moe.grouped_experts` (one grouped matmul per projection) rather than the loop."""
        self.register_buffer("cpu_gate_up", None)  # [E, 2 I / w, d, w] the fused C kernel's panels (`fuse_cpu`)
        self.register_buffer("cpu_down", None)  # [E, d / w, I, w]

    def fuse(self) -> None:
        """The step through the fused kernels (`cuda_moe`) from now on: the weights (after any quantization)
        stacked, each expert's Linear a view of them."""
        from pdserve.server.decode.cuda_moe import stack_experts

        self.fused = self.stacked or stack_experts(list(self.gate_up), list(self.down))

    def group(self) -> None:
        """The step through torch's grouped matmul (`cpu_moe.grouped_experts`) from now on: the experts' (plain
        float) weights stacked, each expert's Linear a view of them."""
        from pdserve.server.decode.cuda_moe import stack_experts

        self.stacked = self.stacked or self.fused or stack_experts(list(self.gate_up), list(self.down))
        self.grouped = True

    def fuse_cpu(self, width: int) -> None:
        """The step through the fused C kernel (`cpu_moe_kernel`, panels `width` outputs wide) from now on: the
        experts' (plain fp32/bf16) weights laid out in its panels, in place of their own (the Linears keep empty
        weights: the other paths are off)."""
        self.cpu_panels = self.panels(width)
        empty = torch.empty(0, dtype=self.router.dtype)
        for m in (*self.gate_up, *self.down):
            m.weight = nn.Buffer(empty)
        self.stacked = None
        self.grouped = False

    def panels(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate|up, down) laid out for the fused C kernel (copies; `cpu_moe_kernel.pack`)."""
        from pdserve.server.decode.cpu_moe_kernel import pack

        if self.stacked is not None:
            gate_up, down = self.stacked.gate_up, self.stacked.down
        else:
            gate_up = torch.stack([m.weight for m in self.gate_up])  # [E, 2 I, d]
            down = torch.stack([m.weight for m in self.down])  # [E, d, I]
        return pack(gate_up, width), pack(down, width)

    @property
    def cpu_panels(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(gate|up, down) in the fused C kernel's panels (`cpu_moe_kernel.pack`) once `fuse_cpu` ran (buffers, so
        that the weights' memory counts them): the step through the kernel, the experts' Linears emptied."""
        return None if self.cpu_gate_up is None else (self.cpu_gate_up, self.cpu_down)

    @cpu_panels.setter
    def cpu_panels(self, panels: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        self.cpu_gate_up, self.cpu_down = (None, None) if panels is None else panels

    @property
    def cpu_fused(self) -> bool:
        return self.cpu_panels is not None

    @property
    def reads_plain(self) -> bool:
        """Its step reads the experts' weights as loaded or repacked (grouped matmul, fused kernels): not to be
        prepacked for oneDNN."""
        return self.grouped or self.cpu_fused or self.fused is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, S, d] -> [B, S, d]
        flat = x.reshape(-1, x.shape[-1])  # [T, d]
        weights, experts = route(F.linear(flat, self.router), self.moe, self.correction_bias)  # [T, k] each
        if self.fused is not None:
            from pdserve.server.decode.cuda_moe import fused_experts

            return fused_experts(flat, weights, experts, self.fused, self.act).view(x.shape)
        if self.cpu_panels is not None:
            from pdserve.server.decode.cpu_moe_kernel import fused_experts as cpu_fused_experts

            return cpu_fused_experts(flat, weights, experts, *self.cpu_panels, self.act).view(x.shape)
        if self.grouped:
            from pdserve.server.decode.cpu_moe import grouped_experts

            return grouped_experts(flat, weights, experts, self.stacked, self.act).view(x.shape)
        chosen = experts.flatten()  # [T k]: each token's k copies, token-major
        order = chosen.argsort(stable=True)  # copies sorted by expert
        tokens = order // self.moe.top_k  # [T k]
        rows = flat[tokens]  # [T k, d]
        counts = torch.bincount(chosen, minlength=self.moe.num_experts).tolist()  # (host) rows per expert
        outs = []
        start = 0
        for e, n in enumerate(counts):
            if n:
                gate, up = self.gate_up[e](rows[start : start + n]).chunk(2, dim=-1)  # [n, I] each (views)
                outs.append(self.down[e](activation(gate, self.act, inplace=True).mul_(up)))  # [n, d]
                start += n
        return combine(torch.cat(outs), weights, order, tokens).to(x.dtype).view(x.shape)
