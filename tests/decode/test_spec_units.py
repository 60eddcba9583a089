"""The speculative config's parsing, the n-gram proposer and the measured-cost policy, by hand."""

from __future__ import annotations

import pytest

from pdserve.server.decode.spec.config import SpeculativeConfig, parse_speculative_config
from pdserve.server.decode.spec.ngram import NgramProposer
from pdserve.server.decode.spec.policy import SpecPolicy, bucket
from pdserve.server.decode.spec.rejection import accepted


def test_vllm_keys_parse_and_one_lookup_bound_gives_the_other():
    assert parse_speculative_config(None) is None and parse_speculative_config("  ") is None
    c = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}')
    assert c == SpeculativeConfig("ngram", 5, 4, 4)
    c = parse_speculative_config('{"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 5, '
                                 '"disable_by_batch_size": 8}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max, c.disable_by_batch_size) == (2, 5, 8)


@pytest.mark.parametrize("text, words", [
    ("[1]", "must be a JSON object"),
    ("{method: ngram}", "must be a JSON object"),
    ('{"num_speculative_tokens": 3}', "method is required"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be >= 1"),
    ('{"method": "ngram", "num_speculative_tokens": "3"}', "must be an integer"),
    ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_min <= prompt_lookup_max"),
    ('{"method": "mtp"}', "method must be one of"),
])
def test_a_bad_config_is_refused_naming_the_key(text, words):
    with pytest.raises(ValueError, match=words):
        parse_speculative_config(text)


def test_ngram_takes_the_longest_suffix_match_at_its_latest_occurrence_with_k_tokens_after_it():
    p = NgramProposer(k=3, min_n=1, max_n=3)
    assert p.propose([1, 2, 3, 4, 1, 2, 3]) == [4, 1, 2]
    assert p.propose([1, 2, 3, 9, 8, 2, 3, 7, 2, 3]) == [7, 2, 3]  # [2, 3] twice: the latest
    assert p.propose([5, 1, 2, 6, 7, 9, 2]) == [6, 7, 9]  # only a 1-gram recurs
    assert p.propose([1, 2, 3, 4, 5]) == []
    assert p.propose([1, 2, 1], k=0) == [] and p.propose([7]) == []
    assert p.propose([4, 4, 4, 4]) == [4]  # the only earlier [4, 4, 4] is followed by one token
    assert p.propose([4, 4, 4, 4, 4, 4, 4]) == [4, 4, 4]  # a loop: not the latest occurrence (one token after it)
    assert p.propose([1, 2, 8, 9, 1, 2, 7]) == [] and p.propose([1, 2, 8, 9, 3, 1, 2]) == [8, 9, 3]
    assert p.propose([1, 2, 8, 1, 2, 9, 9, 1, 2]) == [9, 9, 1]  # the latest with 3 after it
    assert NgramProposer(k=2, min_n=2, max_n=2).propose([5, 1, 2, 6, 7, 9, 2]) == []


def test_accepted_is_the_common_prefix():
    assert accepted([4, 5, 6], [4, 5, 7, 1]) == 2
    assert accepted([4, 5, 6], [4, 5, 6, 1]) == 3
    assert accepted([4], [3, 9]) == 0 and accepted([], [3]) == 0


def test_the_policy_measures_then_keeps_speculation_where_it_pays_and_drops_it_where_it_costs():
    assert [bucket(b) for b in (1, 2, 3, 4, 5, 16, 17)] == [1, 2, 4, 4, 8, 16, 32]
    policy = SpecPolicy(k=3, explore_every=1000)
    assert policy.cap(1, [3]) == 3  # nothing measured: the full k, measured
    policy.observe_step(1, 4, 0.011)
    assert policy.cap(1, [3]) == 0  # then a plain step, measured
    policy.observe_step(1, 1, 0.010)
    for _ in range(20):
        policy.observe_acceptance(3, 3)
    assert policy.cap(1, [3]) == 3  # bandwidth-bound: 4 positions cost ~1 (2 and 3, not measured, no more); ~4 tokens
    assert policy.cap(1, [0]) == 0  # nothing proposed
    # batch 16, compute-bound: 4 positions cost 4x; nothing accepted
    policy.observe_step(16, 4, 0.4)
    policy.observe_step(16, 1, 0.1)
    for _ in range(40):
        policy.observe_acceptance(3, 0)
    assert policy.cap(16, [3] * 16) == 0
    assert SpecPolicy(k=3, disable_by_batch_size=4).cap(4, [3] * 4) == 0


def test_the_policy_explores_the_full_k_and_the_plain_step_now_and_then():
    policy = SpecPolicy(k=2, explore_every=4)
    policy.observe_step(1, 1, 0.01)
    policy.observe_step(1, 2, 0.5)
    policy.observe_step(1, 3, 1.0)  # speculation looks ruinous
    caps = [policy.cap(1, [2]) for _ in range(32)]
    # explorations at 4, then (nothing taken after it) 8 steps on at 12, then 16 steps on at 28
    assert [n + 1 for n, c in enumerate(caps) if c] == [4, 12, 28]


def test_explorations_come_back_to_every_explore_every_steps_once_speculation_pays_again():
    policy = SpecPolicy(k=2, explore_every=4, max_explore_every=8)
    policy.observe_step(1, 1, 0.01)
    policy.observe_step(1, 2, 0.5)
    policy.observe_step(1, 3, 1.0)
    caps = [policy.cap(1, [2]) for _ in range(20)]
    assert [n + 1 for n, c in enumerate(caps) if c] == [4, 12, 20]  # the interval doubles to its cap, 8
    for _ in range(40):  # now bandwidth-bound: 2 and 3 positions cost what 1 does (the averages follow)
        policy.observe_step(1, 2, 0.0101)
        policy.observe_step(1, 3, 0.0102)
    for _ in range(20):
        policy.observe_acceptance(2, 2)
    caps = [policy.cap(1, [2]) for _ in range(8)]  # steps 21..28: taken; 24 is the plain re-measure
    assert caps[0] == 2 and caps[3] == 0 and caps[4:7] == [2, 2, 2]
    assert caps[7] == 2  # step 28 explores (the full k); from here on every 4 steps, since it was taken
    caps = [policy.cap(1, [2]) for _ in range(4)]  # 29..32: the plain re-measure at 30, exploration at 32
    assert caps == [2, 0, 2, 2]


def _brute_force(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        ends = [e for e in range(n - 1, L - 1) if tokens[e - n + 1 : e + 1] == tokens[L - n :]]
        if ends:
            full = [e for e in ends if L - (e + 1) >= k]
            start = (full[-1] if full else ends[0]) + 1
            return tokens[start : start + k]
    return []


def test_ngram_agrees_with_a_brute_force_search_on_random_sequences():
    import random

    rng = random.Random(0)
    for _ in range(500):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        k, lo = rng.randrange(1, 5), rng.randrange(1, 4)
        hi = rng.randrange(lo, 5)
        assert NgramProposer(k, lo, hi).propose(tokens) == _brute_force(tokens, k, lo, hi), (tokens, k, lo, hi)


def test_the_lookup_is_skipped_while_speculation_is_measured_not_to_pay_and_explored_on_schedule():
    policy = SpecPolicy(k=2, explore_every=4)
    assert policy.worth_looking(1)  # nothing measured
    policy.observe_step(1, 1, 0.01)
    policy.observe_step(1, 2, 0.5)
    policy.observe_step(1, 3, 1.0)
    looks = []
    for _ in range(8):
        looks.append(policy.worth_looking(1))
        if looks[-1]:
            policy.cap(1, [2])
        else:
            policy.skipped(1)
    # nothing taken: no plain re-measure (every step is plain), the full-k try at 4, then 8 steps on at 12
    assert looks == [False, False, False, True, False, False, False, False]
    assert not SpecPolicy(k=2, disable_by_batch_size=3).worth_looking(3)
