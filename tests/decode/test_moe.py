"""Mixture-of-experts models on the decode tier against transformers: prefill on this tier, then decode steps
of a batch, through the loop over chosen experts, torch's grouped matmul and the fused C kernel (`cpu_moe`); int8 expert
weights stay close."""

from __future__ import annotations

import pytest
import torch
import transformers

from pdserve.kvcache.layout import KvLayout
from pdserve.server.decode.kv_cache import PagedKvCache
from pdserve.server.decode.moe import MoeMlp
from pdserve.server.decode.weights import build_model
from pdserve.server.model.config import MoeConfig, load_config
from pdserve.server.model.weights import load_weights

TOL = 1e-4
NEW_TOKENS = 8
BLOCK = 4


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def models(request, tiny_model):
    path = tiny_model(request.param)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf, load_config(path), load_weights(path)


def _generate(model, prompts: list[torch.Tensor]) -> list[list[int]]:
    """Each prompt prefilled alone, then all decoded together as one batch."""
    c = model.config
    cache = PagedKvCache(KvLayout(c.num_layers, c.num_kv_heads, c.head_dim, BLOCK, "float32"), 64)
    width = -(-(max(map(len, prompts)) + NEW_TOKENS) // BLOCK)
    tables = [list(range(i * width, (i + 1) * width)) for i in range(len(prompts))]
    tokens = [[int(model.prefill(p, t, cache)[-1].argmax())] for p, t in zip(prompts, tables)]
    lengths = torch.tensor([len(p) for p in prompts])
    for step in range(NEW_TOKENS - 1):
        positions = lengths + step
        logits = model.decode(torch.tensor([t[-1] for t in tokens]), positions, torch.tensor(tables), positions + 1,
                              cache)
        for row, token in enumerate(logits.argmax(-1).tolist()):
            tokens[row].append(token)
    return tokens


@pytest.mark.parametrize("path", ["loop", "grouped", "fused"])
def test_batched_decode_matches_transformers_generate(models, path):
    """Greedy tokens equal transformers' through every CPU expert step (`cpu_moe`): the loop over chosen experts
    (the fallback), torch's grouped matmul and the fused C kernel."""
    hf, config, weights = models
    model = build_model(config, weights)
    moe = [layer.experts for layer in model.layers if layer.experts is not None]
    assert moe
    for mlp in moe:
        if path == "grouped":
            mlp.group()
        elif path == "fused":
            from pdserve.server.decode import cpu_moe_kernel

            mlp.fuse_cpu(cpu_moe_kernel.load().width)
        assert mlp.grouped == (path == "grouped") and mlp.cpu_fused == (path == "fused")
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
               for n in (5, 17, 30)]
    got = _generate(model, prompts)
    for prompt, tokens in zip(prompts, got):
        want = hf.generate(prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.int64), do_sample=False,
                           max_new_tokens=NEW_TOKENS)[0, len(prompt):].tolist()
        assert tokens == want


def test_int8_experts_compute_what_their_dequantized_weights_do(models):
    """int8 expert weights (every Linear, per output channel; the router stays fp32): the model's logits equal
    those of the fp32 model holding the dequantized weights (how close int8 is to fp32 depends on the
    random weights, so it is not asserted here)."""
    from pdserve.server.decode.quant import Linear

    _, config, weights = models
    int8, plain = build_model(config, weights, weight_format="int8"), build_model(config, weights)
    assert int8.layers[0].experts.gate_up[0].weight.dtype == torch.int8
    assert int8.layers[0].experts.router.dtype == torch.float32  # routing in the compute dtype
    quantized = {name: m for name, m in int8.named_modules() if isinstance(m, Linear)}
    for name, m in plain.named_modules():
        if isinstance(m, Linear):
            m.weight.copy_(quantized[name].dequantized())
    ids = torch.randint(0, config.vocab_size, (12,), generator=torch.Generator().manual_seed(3))
    c = config
    logits = []
    for model in (plain, int8):
        cache = PagedKvCache(KvLayout(c.num_layers, c.num_kv_heads, c.head_dim, BLOCK, "float32"), 8)
        logits.append(model.prefill(ids, list(range(4)), cache))
    assert (logits[0] - logits[1]).abs().max() < 1e-3


def test_each_chosen_expert_runs_once_over_all_its_rows():
    """A step of 6 tokens: the experts they chose run once each (whatever the tokens' number), the others
    not at all, and the result equals a per-token loop."""
    moe = MoeConfig(num_experts=6, top_k=2, intermediate_size=8, renormalize=False)
    torch.manual_seed(0)
    mlp = MoeMlp(moe, 16, "silu", torch.float32, "cpu")
    for buffer in mlp.buffers():
        buffer.normal_()
    calls: dict[int, list[int]] = {}
    for e, linear in enumerate(mlp.gate_up):
        linear.register_forward_hook(lambda _m, args, _o, e=e: calls.setdefault(e, []).append(args[0].shape[0]))
    x = torch.randn(2, 3, 16)
    out = mlp(x)
    probs = (x.reshape(-1, 16) @ mlp.router.T).softmax(-1)
    weights, experts = probs.topk(2, dim=-1)
    chosen = experts.flatten().tolist()
    assert calls == {e: [chosen.count(e)] for e in sorted(set(chosen))}
    want = torch.zeros(6, 16)
    for t in range(6):
        for w, e in zip(weights[t], experts[t]):
            gate, up = mlp.gate_up[e](x.reshape(-1, 16)[t]).chunk(2)
            want[t] += w * mlp.down[e](torch.nn.functional.silu(gate) * up)
    torch.testing.assert_close(out.reshape(-1, 16), want, rtol=1e-5, atol=1e-5)
