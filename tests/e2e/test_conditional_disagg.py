"""A conversation through real processes (coordinator, JAX prefill, torch decode): turn 2 is turn 1's prompt, its
answer and new text. The decode worker's prefix cache holds the answer's full blocks (kept as they completed), so
turn 2 hits them; with the suffix under --conditional-disagg-max-uncached the decode worker prefills it itself (the
prefill worker computes nothing, no KV crosses the wire), over it the prefill tier computes it and sends only the
blocks the decode worker lacks; both give transformers' greedy tokens.
"""

from __future__ import annotations

import pytest

from tests.e2e.procs import Procs, counter, generate, request
from tests.e2e.test_prefix_cache import hf_greedy

BLOCK = 16
ANSWER = 41
"""Turn 1's answer: with a 40-token prompt, 81 tokens whose first 80 have KV: 5 full blocks, the last two the
answer's alone."""


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    procs = Procs(tiny_model("qwen2"), tmp_path_factory.mktemp("conversation"))
    try:
        coordinator = procs.coordinator("coordinator", "--conditional-disagg-max-uncached", "2048")  # Dynamo's threshold
        p0 = procs.worker("p0", "prefill", coordinator)
        d0 = procs.worker("d0", "decode", coordinator, "--threads", "1")
        # a second coordinator over the same workers, with a threshold of 8 tokens
        procs.coordinator("strict", "--conditional-disagg-max-uncached", "8", "--prefill", p0.address,
                          "--decode", d0.address)
        yield procs
    finally:
        procs.stop_all()


def _counters(procs: Procs, coordinator: str) -> dict[str, float]:
    c, p, d = (procs.procs[n].metrics() for n in (coordinator, "p0", "d0"))
    return {
        "local": c.get('pdserve_conditional_disagg_total{where="local"}', 0.0),
        "remote": c.get('pdserve_conditional_disagg_total{where="remote"}', 0.0),
        "p0 computed": counter(p, "pdserve_prefill_computed_tokens_total"),
        "d0 computed": counter(d, "pdserve_prefill_computed_tokens_total"),
        "d0 hits": counter(d, "pdserve_prefix_cache_hits_total"),
        "d0 received": counter(d, "pdserve_kv_transfer_bytes_total"),
    }


def _turns(procs: Procs, coordinator: str, seed: int, new: int, answer_len: int = ANSWER
           ) -> tuple[list[int], dict[str, float], dict[str, float]]:
    """Turn 1 (a fresh 40-token prompt, an answer of answer_len), then turn 2 (its history and `new` tokens); turn 2's
    prompt and the counters' changes over turn 1 and over turn 2."""
    address = procs.procs[coordinator].address
    prompt = [(seed * i + 5) % 400 + 3 for i in range(40)]
    before = _counters(procs, coordinator)
    answer = generate(address, request(prompt, answer_len))
    assert answer == hf_greedy(procs.model_dir, prompt, answer_len)
    middle = _counters(procs, coordinator)
    turn2 = prompt + answer + [(seed * i + 7) % 400 + 3 for i in range(new)]
    assert generate(address, request(turn2, 8)) == hf_greedy(procs.model_dir, turn2, 8)
    after = _counters(procs, coordinator)
    return turn2, {k: middle[k] - before[k] for k in before}, {k: after[k] - middle[k] for k in before}


def test_a_short_next_turn_is_prefilled_on_the_decode_worker_that_holds_the_answer(cluster):
    turn2, first, second = _turns(cluster, "coordinator", seed=7, new=6)
    # turn 1: a prompt nobody holds goes to the prefill tier, which computes it whole
    assert (first["local"], first["remote"], first["p0 computed"], first["d0 computed"]) == (0, 1, 40, 0)
    # turn 2: 87 tokens; the decode worker holds 80 (the prompt's 2 blocks, a mixed one, the answer's 2), computes
    # the other 7 itself; the prefill worker computes nothing and no KV is sent
    assert len(turn2) == 87 and second["d0 hits"] == 5 * BLOCK
    assert (second["local"], second["remote"], second["d0 computed"], second["p0 computed"], second["d0 received"]) \
        == (1, 0, 7, 0, 0)


def test_a_long_next_turn_goes_to_the_prefill_tier_which_sends_only_what_decode_lacks(cluster):
    turn2, first, second = _turns(cluster, "strict", seed=11, new=12)
    per_token = first["d0 received"] / 40  # fp32 K and V of every layer, for each token sent
    assert first["remote"] == 1 and per_token > 0
    # turn 2: 93 tokens, 80 held by the decode worker, 13 >= 8 left: the prefill tier computes them (and the
    # answer's tokens it never saw: its prefix KV holds the prompt's 2 blocks), and sends the 13 alone
    assert len(turn2) == 93 and second["d0 hits"] == 5 * BLOCK
    assert (second["local"], second["remote"], second["d0 computed"]) == (0, 1, 0)
    assert second["p0 computed"] == 93 - 2 * BLOCK and second["d0 received"] == per_token * 13


def test_a_history_ending_mid_block_is_computed_from_its_kept_tail(cluster):
    """Turn 1's 40 + 30 tokens, KV for 69: 4 full blocks and 5 tokens of a fifth, kept as a tail when turn 1 ends;
    turn 2 computes only the answer's last token and its 6 new ones (without the tail: those 5 too)."""
    turn2, first, second = _turns(cluster, "coordinator", seed=13, new=6, answer_len=30)
    assert first["remote"] == 1
    assert len(turn2) == 76 and second["d0 hits"] == 69
    assert (second["local"], second["remote"], second["d0 computed"], second["p0 computed"], second["d0 received"]) \
        == (1, 0, 7, 0, 0)
