import torch

from pdserve.server.decode.sampler import greedy, sample


def _params(b: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0):
    return (
        torch.full((b,), temperature),
        torch.full((b,), top_k, dtype=torch.int64),
        torch.full((b,), top_p),
    )


def test_greedy_rows_are_argmax():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    out = sample(logits, *_params(5, temperature=0.0), [None] * 5, [0] * 5)
    assert out.dtype == torch.int64
    assert torch.equal(out, logits.argmax(-1))


def test_greedy_takes_the_first_of_equal_maxima_over_a_large_vocabulary():
    logits = torch.zeros(3, 151936)
    logits[0, [7, 9, 151935]] = 2.0
    logits[1, [151935, 100000]] = 1.0
    logits[2, 5] = float("nan")  # as argmax: a NaN row picks its NaN
    out = sample(logits, *_params(3, temperature=0.0), [None] * 3, [0] * 3)
    assert out.tolist() == [7, 100000, 5]


def test_top_k_1_and_tiny_top_p_are_argmax_at_temperature_1():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    for _ in range(20):
        assert torch.equal(sample(logits, *_params(6, top_k=1), [None] * 6, [0] * 6), logits.argmax(-1))
        assert torch.equal(sample(logits, *_params(6, top_p=1e-6), [None] * 6, [0] * 6), logits.argmax(-1))


def test_same_seed_and_index_give_the_same_token_in_a_mixed_batch():
    logits = torch.zeros(4, 1000)  # uniform: any change of randomness shows in the token
    temperature = torch.tensor([1.0, 1.0, 0.0, 1.0])
    top_k = torch.zeros(4, dtype=torch.int64)
    top_p = torch.ones(4)
    seeds = [7, None, None, 7]
    first = sample(logits, temperature, top_k, top_p, seeds, [3, 3, 3, 4])
    again = sample(logits, temperature, top_k, top_p, seeds, [3, 0, 0, 4])
    assert first[0] == again[0] and first[3] == again[3]  # seeded rows repeat
    assert first[2] == again[2] == 0  # the greedy row takes argmax (first of equal maxima)
    # A seeded row does not depend on its position in the batch or on its neighbours.
    alone = sample(logits[:1], temperature[:1], top_k[:1], top_p[:1], [7], [3])
    assert alone[0] == first[0]
    # Other indices or seeds give other draws; unseeded rows vary run to run.
    draws = {int(sample(logits[:1], temperature[:1], top_k[:1], top_p[:1], [7], [i])[0]) for i in range(20)}
    assert len(draws) > 10
    row = (logits[1:2], temperature[1:2], top_k[1:2], top_p[1:2])
    unseeded = {int(sample(*row, [None], [3])[0]) for _ in range(20)}
    assert len(unseeded) > 10


def test_empirical_distribution_matches_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    n = 20000
    counts = torch.zeros(4)
    batch = logits.expand(n, 4)
    tokens = sample(batch, *_params(n), list(range(n)), [0] * n)
    counts += torch.bincount(tokens, minlength=4)
    freq = counts / n
    assert (freq - logits.softmax(-1)[0]).abs().max() < 0.02


def test_temperature_and_top_p_shape_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    n = 20000
    batch = logits.expand(n, 4)
    hot = torch.bincount(sample(batch, *_params(n, temperature=2.0), [None] * n, [0] * n), minlength=4) / n
    assert (hot - (logits / 2).softmax(-1)[0]).abs().max() < 0.02
    # top_p 0.8: softmax is [0.61, 0.22, 0.14, 0.03]; tokens 0 and 1 reach 0.83, so 2 and 3 drop out.
    nucleus = torch.bincount(sample(batch, *_params(n, top_p=0.8), [None] * n, [0] * n), minlength=4) / n
    kept = logits[0, :2].softmax(-1)
    assert nucleus[2:].sum() == 0
    assert (nucleus[:2] - kept).abs().max() < 0.02


def test_top_k_2_never_leaves_the_top_2():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(64, 30, generator=g)
    top2 = logits.topk(2, dim=-1).indices  # [B, 2]
    for _ in range(50):
        out = sample(logits, *_params(64, top_k=2), [None] * 64, [0] * 64)
        assert ((out[:, None] == top2).any(-1)).all()
    seen = sample(logits.repeat(100, 1), *_params(6400, top_k=2), [None] * 6400, [0] * 6400)
    assert (seen.view(100, 64) == top2[:, 1]).any()  # the second token does get drawn


def test_min_p_keeps_only_tokens_above_min_p_times_the_top_probability():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.09, 0.01])  # min_p 0.6: 0.2 and below fall (< 0.6 x 0.4)
    logits = probs.log().repeat(300, 1)  # [B, V]
    drawn = sample(logits, *_params(300), list(range(300)), list(range(300)), torch.full((300,), 0.6))
    assert set(drawn.tolist()) == {0, 1}
    drawn = sample(logits, *_params(300), list(range(300)), list(range(300)), torch.zeros(300))
    assert set(drawn.tolist()) >= {0, 1, 2, 3}


def test_a_seeded_row_without_filters_draws_the_same_beside_rows_that_sort():
    """Rows without top-k/top-p walk the vocabulary in id order, rows with them the sorted order: the
    path is each row's own, so a neighbour's filters never change a seeded row's token."""
    logits = torch.randn(3, 200, generator=torch.Generator().manual_seed(5))
    temperature, top_p = torch.ones(3), torch.tensor([1.0, 0.9, 1.0])
    top_k = torch.tensor([0, 0, 5])
    mixed = sample(logits, temperature, top_k, top_p, [11, 11, 11], [2, 2, 2])
    for row in range(3):
        alone = sample(logits[row : row + 1], temperature[:1], top_k[row : row + 1], top_p[row : row + 1],
                       [11], [2])
        assert alone[0] == mixed[row]
    assert mixed[2] in logits[2].topk(5).indices


def test_apply_bitmask_keeps_exactly_the_allowed_ids_and_leaves_free_rows_alone():
    import numpy as np

    from pdserve.server.decode.sampler import apply_bitmask
    from pdserve.server.structured.bitmask import unconstrained

    masks = unconstrained(2, 40)  # [2, 2] words
    masks[1] = 0
    masks[1, 0] = np.uint32((1 << 3) | (1 << 31)).view(np.int32)
    masks[1, 1] = 1 << 7  # token 39
    logits = torch.arange(80, dtype=torch.float32).reshape(2, 40)
    out = apply_bitmask(logits, torch.from_numpy(masks))
    assert torch.equal(out[0], logits[0])
    assert torch.isfinite(out[1]).nonzero()[:, 0].tolist() == [3, 31, 39]
    assert greedy(out).tolist() == [39, 39]
    assert sample(out, torch.tensor([0.0, 1.0]), torch.tensor([0, 0]), torch.tensor([1.0, 1.0]), [None, 1], [0, 0]
                  )[1].item() in (3, 31, 39)
