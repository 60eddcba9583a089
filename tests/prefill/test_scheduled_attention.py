"""The static-schedule attention (what GPUs run: no per-block conditional) against the whole-matrix reference,
on the CPU, and its schedule by hand."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdserve.server.prefill.attention import block_schedule, reference_attention, scheduled_attention
from tests.prefill.test_attention import CASES, _packed


def test_schedule_visits_the_context_then_own_blocks_up_to_the_diagonal():
    # 3 query blocks of 4, 2 context key blocks (c0, c1 = 0, 1), own key blocks of 2 (2, 3, ...): query block i
    # ends at own index 4 i + 3, in own block (4 i + 3) // 2.
    qi, kj = block_schedule(3, 4, 2, 6, 2)
    assert list(zip(qi.tolist(), kj.tolist())) == [
        (0, 0), (0, 1), (0, 2), (0, 3),
        (1, 0), (1, 1), (1, 2), (1, 3), (1, 4), (1, 5),
        (2, 0), (2, 1), (2, 2), (2, 3), (2, 4), (2, 5), (2, 6), (2, 7)]
    qi, kj = block_schedule(2, 4, 3, 0, 4)  # no own keys known: every key block for every query block
    assert list(zip(qi.tolist(), kj.tolist())) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]


def _own_keys_from(case: str) -> int:
    """The test layout's keys: every segment's context, then the queries' own (in the queries' order)."""
    _, contexts, _ = CASES[case]
    return sum(contexts)


@pytest.mark.parametrize("own", [True, False])
@pytest.mark.parametrize("blocks", [(16, 8), (8, 16), (32, 32)])
@pytest.mark.parametrize("case", CASES)
def test_scheduled_equals_reference(case, blocks, own):
    lengths, contexts, total = CASES[case]
    q, k, v, qp, qs, kp, ks, real = _packed(4, lengths, contexts, total)
    want = np.asarray(reference_attention(q, k, v, qp, qs, kp, ks))
    got = np.asarray(scheduled_attention(q, k, v, qp, qs, kp, ks, own_keys_from=_own_keys_from(case) if own else None,
                                         block_q=blocks[0], block_k=blocks[1]))
    np.testing.assert_allclose(got[:, :real], want[:, :real], rtol=1e-5, atol=1e-5)
    assert np.isfinite(got).all()


def test_scheduled_has_no_conditional_and_a_known_trip_count():
    """The compiled program holds no conditional (a host round-trip per block on XLA:GPU), and the one loop
    runs the schedule's pairs: 16 query blocks of 256 over their own key blocks up to the diagonal, 136."""
    s, hq, d = 4096, 2, 16
    args = (jnp.zeros((1, s, hq, d)), jnp.zeros((1, s, 1, d)), jnp.zeros((1, s, 1, d)), *(jnp.zeros((1, s), jnp.int32),) * 4)
    lowered = jax.jit(lambda *a: scheduled_attention(*a, own_keys_from=0, block_q=256, block_k=256)).lower(*args)
    text = lowered.as_text()
    assert "stablehlo.case" not in text and "stablehlo.if" not in text
    assert len(block_schedule(16, 256, 0, 16, 256)[0]) == 136
    compiled = lowered.compile()
    loops = [line for line in compiled.as_text().splitlines() if " while(" in line]
    assert len(loops) == 1 and '"known_trip_count":{"n":"136"}' in loops[0]
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < s * s * 4 // 8, f"{temp} bytes of temporaries for {s} tokens: an S x S buffer is back"


def test_own_keys_from_must_leave_the_queries_own():
    q, k, v, qp, qs, kp, ks, _ = _packed(5, [24], [40], 32)
    with pytest.raises(ValueError, match="not the 32 queries' own"):
        scheduled_attention(q, k, v, qp, qs, kp, ks, own_keys_from=30)


def test_the_model_on_the_gpus_attention_gives_the_cpus_logits(tiny_model, monkeypatch):
    """The prefill model with `attention` choosing as on a GPU (the static schedule, the model's own keys after
    its context) gives the logits the CPU's blockwise path gives."""
    from pdserve.server.model.config import load_config
    from pdserve.server.model.weights import load_weights
    from pdserve.server.prefill import attention as attention_module
    from pdserve.server.prefill.model import forward_logits, load_params

    path = tiny_model("llama")
    config = load_config(path)
    params = load_params(config, load_weights(path))
    tokens = jnp.asarray(np.random.default_rng(6).integers(0, 512, size=(1, 40), dtype=np.int32))
    cpu = np.asarray(forward_logits(params, tokens, config=config))
    monkeypatch.setattr(attention_module, "GPU_BLOCK", 16)  # several blocks at 40 tokens
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    calls = []
    scheduled = attention_module.scheduled_attention
    monkeypatch.setattr(attention_module, "scheduled_attention", lambda *a, **kw: calls.append(kw) or scheduled(*a, **kw))
    gpu = np.asarray(forward_logits(params, tokens, config=config))
    assert calls and calls[0]["own_keys_from"] == 0 and calls[0]["block_q"] == 16
    np.testing.assert_allclose(gpu, cpu, rtol=0, atol=1e-4)
