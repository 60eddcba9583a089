"""The step's sampling batch: exact per-row tensors of a hand-made mixed batch, its rows at later positions, and
its draws equal to the sampler's math fed by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.server.decode import sampler
from pdserve.server.decode.sampling import SamplingBatch
from pdserve.server.decode.sequence import Sequence

V = 64
EOS = frozenset({2})
ALLOWED = [5, 7, 40]
"""The grammar row's next tokens."""


class FixedGrammar:
    """A constraint whose next-token mask is ALLOWED (what the batch builder reads of a grammar: `fill`)."""

    def fill(self, row: np.ndarray) -> None:
        row[:] = 0
        for t in ALLOWED:
            row[t // 32] |= np.int32(1 << (t % 32))


def _seq(rid: str, prompt: list[int], outputs: list[int], prior: int = 0, constraint=None,
         **sampling) -> Sequence:
    seq = Sequence(rid, prompt, gen_pb.SamplingParams(max_tokens=32, **sampling), EOS, 128, num_prior_outputs=prior,
                   constraint=constraint)
    seq.output_ids = outputs
    return seq


def _mixed() -> list[Sequence]:
    return [
        _seq("greedy", [1, 3, 4], [9], temperature=0.0, top_p=1.0, logprobs=2),
        _seq("seeded", [5, 6, 10, 11], [12], prior=2, temperature=0.8, top_p=0.9, seed=7, min_p=0.1, logprobs=0),
        _seq("penalized", [8, 8], [9, 9, 13], temperature=1.0, top_k=5, seed=3, presence_penalty=0.5,
             frequency_penalty=0.25, repetition_penalty=1.5, min_tokens=5, stop_token_ids=[17]),
        _seq("grammar", [20], [], temperature=1.0, seed=4, constraint=FixedGrammar()),
    ]


def _mask_words() -> list[int]:
    return [(1 << 5) | (1 << 7), 1 << 8]


async def test_a_mixed_batch_holds_each_rows_parameters_exactly():
    batch = SamplingBatch.of(_mixed(), V)
    assert torch.equal(batch.temperature, torch.tensor([0.0, 0.8, 1.0, 1.0]))
    assert torch.equal(batch.top_k, torch.tensor([0, 0, 5, 0]))
    assert torch.equal(batch.top_p, torch.tensor([1.0, 0.9, 1.0, 1.0]))  # unset: 1, never 0
    assert torch.equal(batch.min_p, torch.tensor([0.0, 0.1, 0.0, 0.0]))
    assert batch.seeds == [None, 7, 3, 4]
    assert batch.indices == [1, 3, 3, 0]  # outputs so far, a migration's prior outputs included
    p = batch.penalties
    assert p.prompts == [[1, 3, 4], [5, 6], [8, 8], [20]]
    assert p.outputs == [[9], [10, 11, 12], [9, 9, 13], []]
    assert (p.presence, p.frequency, p.repetition) == ([0, 0, 0.5, 0], [0, 0, 0.25, 0], [1, 1, 1.5, 1])
    assert p.blocked == [[], [], [2, 17], []]  # 3 of min_tokens 5 out: EOS and the stop id
    assert batch.bitmask.dtype == torch.int32
    assert batch.bitmask.tolist() == [[-1, -1], [-1, -1], [-1, -1], _mask_words()]
    assert batch.num_logprobs == [2, 0, None, None]
    assert not batch.greedy and not batch.plain


async def test_a_greedy_batch_skips_what_it_does_not_need():
    seqs = [_seq(f"g{i}", [1, 2 + i], [], temperature=0.0, top_p=1.0) for i in range(3)]
    batch = SamplingBatch.of(seqs, V)
    assert batch.greedy and batch.plain
    assert (batch.min_p, batch.penalties, batch.bitmask) == (None, None, None)
    assert batch.num_logprobs == [None] * 3
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0))
    assert torch.equal(batch.sample(logits), logits.max(dim=-1).indices)
    assert batch.logprobs(logits, batch.sample(logits)) == [None] * 3


async def test_rows_taken_after_tokens_move_their_index_penalties_and_min_tokens():
    batch = SamplingBatch.of(_mixed(), V)
    later = batch.take([2, 3], [[13, 2], []])
    assert later.indices == [5, 0]
    assert later.seeds == [3, 4] and torch.equal(later.top_k, torch.tensor([5, 0]))
    assert later.min_p is None  # neither row asks
    assert later.penalties.outputs == [[9, 9, 13, 13, 2], []]
    assert later.penalties.blocked == [[], []]  # min_tokens met at index 5
    assert later.bitmask.tolist() == [[-1, -1], _mask_words()]
    free = batch.take([1, 0])
    assert free.indices == [3, 1] and free.seeds == [7, None] and free.num_logprobs == [0, 2]
    assert (free.penalties, free.bitmask) == (None, None)  # neither row is shaped nor constrained
    assert torch.equal(free.min_p, torch.tensor([0.1, 0.0]))
    with pytest.raises(ValueError, match="in order"):
        batch.positions(2)  # penalties and min_tokens depend on the tokens before each position


async def test_a_plain_batchs_positions_repeat_its_rows_with_their_indices_moved_on():
    seqs = _mixed()
    batch = SamplingBatch.of([seqs[0], seqs[1], seqs[3]], V)
    assert batch.plain
    at = batch.positions(2)
    assert at.indices == [1, 2, 3, 4, 0, 1]
    assert at.seeds == [None, None, 7, 7, 4, 4]
    assert torch.equal(at.temperature, torch.tensor([0.0, 0.0, 0.8, 0.8, 1.0, 1.0]))
    assert at.bitmask.tolist() == [[-1, -1]] * 4 + [_mask_words()] * 2
    assert at.num_logprobs == [2, 2, 0, 0, None, None]


async def test_the_batch_draws_what_the_samplers_math_draws_from_the_same_parameters():
    seqs = _mixed()
    batch = SamplingBatch.of(seqs, V)
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(1)) * 3
    shaped = sampler.apply_penalties(logits, [[1, 3, 4], [5, 6], [8, 8], [20]], [[9], [10, 11, 12], [9, 9, 13], []],
                                     [0, 0, 0.5, 0], [0, 0, 0.25, 0], [1, 1, 1.5, 1], [[], [], [2, 17], []])
    masked = sampler.apply_bitmask(shaped, torch.tensor([[-1, -1]] * 3 + [_mask_words()], dtype=torch.int32))
    want = sampler.sample(masked, torch.tensor([0.0, 0.8, 1.0, 1.0]), torch.tensor([0, 0, 5, 0]),
                          torch.tensor([1.0, 0.9, 1.0, 1.0]), [None, 7, 3, 4], [1, 3, 3, 0],
                          torch.tensor([0.0, 0.1, 0.0, 0.0]))
    got = batch.sample(logits)
    assert got.tolist() == want.tolist()
    assert got[0] == logits[0].argmax() and got[3] in ALLOWED and got[2] not in (2, 17)
    lps = batch.logprobs(logits, got)
    assert lps[2:] == [None, None]
    top2 = logits[0].log_softmax(-1).topk(2)
    assert lps[0].token_id == got[0] and list(lps[0].top_token_ids) == top2.indices.tolist()
    assert lps[0].logprob == pytest.approx(float(logits[0].log_softmax(-1)[got[0]]), abs=1e-6)
    assert lps[1].token_id == got[1] and list(lps[1].top_token_ids) == []
    probs = batch.take([1, 2]).distribution(logits[1:3])
    assert torch.allclose(probs, sampler.distribution(shaped[1:3], torch.tensor([0.8, 1.0]), torch.tensor([0, 5]),
                                                      torch.tensor([0.9, 1.0]), torch.tensor([0.1, 0.0])))
    assert probs[1, 2] == 0 and probs[1, 17] == 0  # blocked by min_tokens
