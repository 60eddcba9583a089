"""Cold prefill steps (a step after the worker sat idle: the same CPU, less of it in parallel): the profile's
factors, their fit from measured rows, and the simulator's steps, checked by hand (sums of powers of two)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pdserve.server.plan.cluster import ClusterSpec, simulate
from pdserve.server.plan.contention import HostCpu
from pdserve.benchmarks.plan.measure import cold_fit
from pdserve.server.plan.profile import DecodeCost, HandoffCost, PrefillCost, Profile, ProfileError
from pdserve.server.plan.workload import SimRequest

COLD = PrefillCost(0.25, 0.0, cold_after_s=0.5, cold_factors=((16, 2.0), (256, 4.0)))


def _profile(prefill: PrefillCost = COLD) -> Profile:
    return Profile("scripted", "m", prefill, DecodeCost(0.0625, 0.0), HandoffCost(0.0, 1e30, 0), 4096, "scripted")


def _requests(*arrivals: float) -> list[SimRequest]:
    return [SimRequest(t, tuple(range(10 + 1000 * i, 26 + 1000 * i)), 3) for i, t in enumerate(arrivals)]


def test_the_factor_of_the_longest_entry_at_most_the_step_applies_after_the_idle_gap():
    assert COLD.cold_factor(16, 0.5) == 2.0 and COLD.cold_factor(255, 9.0) == 2.0 and COLD.cold_factor(256, 1.0) == 4.0
    assert COLD.cold_factor(8, 9.0) == 1.0  # below the first entry
    assert COLD.cold_factor(256, 0.25) == 1.0  # not idle long enough
    assert PrefillCost(0.25, 0.0, cold_factors=((16, 2.0),)).cold_factor(16, 9.0) == 1.0  # cold_after_s 0: never


def test_a_step_after_an_idle_gap_is_cold_and_one_right_after_a_step_is_not():
    """Workers on devices of their own. r0 at 0 (never stepped: cold) prefills 0.25 x 2 = 0.5 s; r1 arrives as
    it ends (no gap): 0.25 s, first token at 0.75; r2 at 2 (idle 1.25 s >= 0.5): cold again, 2.5."""
    result = simulate(_requests(0.0, 0.5, 2.0), ClusterSpec(), _profile())
    assert [o.chunk_times for o in result.outputs] == [
        [0.5, 0.5625, 0.625], [0.75, 0.8125, 0.875], [2.5, 2.5625, 2.625]]


def test_a_cold_step_that_shares_the_cores_anyway_lasts_as_long_as_a_warm_one():
    """The prefill keeps 2 cores busy warm (0.25 s of work: 0.5 CPU seconds), 1 cold (0.5 s). On 2 cores the
    cold step is twice as long; on 1 core both get half of what they ask for warm, all of it cold: 0.5 s."""
    warm = dataclasses.replace(COLD, cold_after_s=0.0)
    first = {}
    for cores in (1.0, 2.0):
        for name, prefill in (("warm", warm), ("cold", COLD)):
            host = HostCpu(cores=cores, prefill_threads=2.0)
            first[cores, name] = simulate(_requests(0.0), ClusterSpec(host=host), _profile(prefill)).outputs[0].ttft
    assert first == {(1.0, "warm"): 0.5, (1.0, "cold"): 0.5, (2.0, "warm"): 0.25, (2.0, "cold"): 0.5}


def test_cold_factors_round_trip_through_json_and_bad_ones_are_refused_by_name(tmp_path):
    path = tmp_path / "p.json"
    _profile().save(path)
    assert Profile.load(path).prefill == COLD
    for bad in (((16, 0.5),), ((0, 2.0),), (("x", 2.0),), ((16,),)):
        with pytest.raises(ProfileError, match="prefill.cold_factors"):
            PrefillCost(0.25, 0.0, cold_after_s=0.5, cold_factors=bad)
    with pytest.raises(ProfileError, match="prefill.cold_after_s"):
        PrefillCost(0.25, 0.0, cold_after_s=-1.0)


def test_the_fit_takes_median_cold_over_median_warm_per_bucket_at_least_one():
    rows = [{"tokens": 16, "gap_s": 0.3, "cold_after_s": 0.075, "warm_s": [0.01, 0.01, 0.03], "cold_s": [0.009] * 3},
            {"tokens": 384, "gap_s": 0.3, "cold_after_s": 0.075, "warm_s": [0.03, 0.04, 0.05], "cold_s": [0.06, 0.06]}]
    assert cold_fit(rows, max_len=512, min_bucket=16) == {"cold_after_s": 0.075, "cold_factors": ((16, 1.0), (512, 1.5))}
    assert cold_fit([], max_len=512, min_bucket=16) == {}


def test_merged_profiles_pool_their_rows_and_a_profile_merged_with_itself_fits_as_it_did(tmp_path):
    from pdserve.benchmarks.plan.measure import merge, merge_rows, refit

    a = {"prefill": [{"tokens": 16}], "prefill_cpu": {"cpu_s": 1.0, "ttft_sum_s": 2.0, "background": 8}}
    b = {"prefill": [{"tokens": 64}], "prefill_cpu": {"cpu_s": 0.5, "ttft_sum_s": 1.0, "background": 8}}
    assert merge_rows([a, b]) == {"prefill": [{"tokens": 16}, {"tokens": 64}],
                                  "prefill_cpu": {"cpu_s": 1.5, "ttft_sum_s": 3.0, "background": 8}}
    shipped = Profile.load(Path(__file__).parents[2] / "benchmarks/plan/profile-cpu.json")
    alone, twice = refit(shipped, 512), merge([shipped, shipped], 512)
    for field in dataclasses.fields(PrefillCost):
        got, want = getattr(twice.prefill, field.name), getattr(alone.prefill, field.name)
        assert got == (want if field.name == "cold_factors" else pytest.approx(want)), field.name
    assert twice.host_cpu == alone.host_cpu
    assert twice.decode.fixed_s == pytest.approx(alone.decode.fixed_s) and twice.notes["merged_from"] == [
        shipped.notes["measured_at"]] * 2
    with pytest.raises(ValueError, match="holds no rows"):
        merge([shipped, dataclasses.replace(shipped, notes={})], 512)
    with pytest.raises(ValueError, match="one machine, model and KV layout"):
        merge([shipped, _profile()], 512)
