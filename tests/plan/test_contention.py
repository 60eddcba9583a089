"""Workers sharing a host's cores (contention.py): max-min fair shares, and the simulator's steps stretched
by them as processor sharing (times are sums of powers of two: exact), checked by hand."""

from __future__ import annotations

import os

import pytest

from pdserve.server.plan.cluster import ClusterSpec, simulate
from pdserve.server.plan.contention import Contention, HostCpu, ProcessCpu, Stepping, fair_shares
from pdserve.benchmarks.plan.procstat import Window
from pdserve.server.plan.profile import DecodeCost, HandoffCost, PrefillCost, Profile
from pdserve.server.plan.workload import SimRequest


def test_fair_shares_give_nobody_more_than_it_asks():
    assert fair_shares(2.0, [1.0, 1.0, 0.25, 0.25]) == [0.75, 0.75, 0.25, 0.25]
    assert fair_shares(1.0, [1.0, 1.0]) == [0.5, 0.5]
    assert fair_shares(2.0, [1.0, 0.5]) == [1.0, 0.5]
    assert fair_shares(2.0, [2.0, 1.0, 0.0]) == [1.0, 1.0, 0.0]


def test_the_front_asks_its_cpu_per_token_times_the_token_rate():
    """500 tokens in the last second at 1 ms of coordinator CPU each: the coordinator asks half a core; two
    workers stepping on 2 cores get (2 - 0.5) / 2 each."""
    host = Contention(HostCpu(cores=2.0, coordinator=ProcessCpu(per_token_s=0.001), window_s=1.0))
    host.token(0.0, 500)
    assert host.front_cores(0.0) == [0.5, 0.0]
    ends = {}
    a = Stepping("prefill-0", 1.0, 0.375, 0.0, lambda at, g: ends.__setitem__("prefill-0", at))
    b = Stepping("decode-0", 1.0, 0.375, 0.0, lambda at, g: ends.__setitem__("decode-0", at))
    host.begin(a, 0.0)
    assert ends == {"prefill-0": 0.375} and a.share == 1.0  # alone beside half a core of coordinator
    host.begin(b, 0.0)
    assert a.share == b.share == 0.75 and ends == {"prefill-0": 0.5, "decode-0": 0.5}


def _profile() -> Profile:
    return Profile("scripted", "m", PrefillCost(0.25, 0.0), DecodeCost(0.0625, 0.0), HandoffCost(0.0, 1e30, 0), 4096,
                   "scripted")


def _requests(*arrivals: float) -> list[SimRequest]:
    return [SimRequest(t, tuple(range(10 + 1000 * i, 26 + 1000 * i)), 3) for i, t in enumerate(arrivals)]


def test_one_request_alone_runs_as_on_cores_of_its_own():
    result = simulate(_requests(0.0), ClusterSpec(host=HostCpu(cores=1.0)), _profile())
    assert result.outputs[0].chunk_times == [0.25, 0.3125, 0.375]


@pytest.mark.parametrize("host", [HostCpu(cores=1.0), HostCpu(cores=2.0, external_cores=1.0)])
def test_a_prefill_and_a_decode_step_at_once_share_one_core(host):
    """One core. r0 prefills alone [0, 0.25]. At 0.25 r1's prefill (0.25 s of work) starts, and r0's first
    decode step (1/16 s) beside it: each at half a core, the decode step ends at 0.375 (r1 has 1/16 done),
    the next one likewise at 0.5 (r1: 1/8 done), the last of r0's tokens. r1's last 1/8 alone: 0.625,
    then its two decode steps alone. On cores of their own r1's first token would come at 0.5."""
    result = simulate(_requests(0.0, 0.25), ClusterSpec(host=host), _profile())
    assert [o.chunk_times for o in result.outputs] == [[0.25, 0.375, 0.5], [0.625, 0.6875, 0.75]]
    alone = simulate(_requests(0.0, 0.25), ClusterSpec(), _profile())
    assert [o.chunk_times for o in alone.outputs] == [[0.25, 0.3125, 0.375], [0.5, 0.5625, 0.625]]


PINNED = {"prefill": 0, "decode": 1, "coordinator": 0, "client": 0}


def test_pinned_workers_share_only_their_own_core():
    """Pinned (plan validate --pin): the coordinator's half core comes off the prefill worker's core only; the
    decode worker's core is its own. With one of the 2 cores' worth of external load, each core has half."""
    for external, prefill, decode in ((0.0, 0.5, 1.0), (1.0, 0.25, 0.5)):
        host = Contention(HostCpu(cores=2.0, external_cores=external, placement=PINNED,
                                  coordinator=ProcessCpu(per_token_s=0.001), window_s=1.0))
        host.token(0.0, 500)
        a = Stepping("prefill-0", 2.0, 0.25, 0.0, lambda at, g: None)  # XLA's 2 threads: pinned, one core
        b = Stepping("decode-0", 1.0, 0.25, 0.0, lambda at, g: None)
        host.begin(a, 0.0)
        host.begin(b, 0.0)
        assert (a.share, b.share) == (prefill, decode)
    # the scripted pair of the one-core test: on their own cores nothing overlaps, as with devices of their own
    result = simulate(_requests(0.0, 0.25), ClusterSpec(host=HostCpu(cores=2.0, placement=PINNED)), _profile())
    assert [o.chunk_times for o in result.outputs] == [[0.25, 0.3125, 0.375], [0.5, 0.5625, 0.625]]


def test_host_cpu_refuses_bad_values_by_name():
    with pytest.raises(ValueError, match="must name a core for each of prefill, decode, coordinator, client"):
        HostCpu(cores=2.0, placement={"prefill": 0})
    assert HostCpu.from_json(HostCpu(cores=2.0, placement=PINNED).to_json()).placement == PINNED
    with pytest.raises(ValueError, match="host cores must be > 0"):
        HostCpu(cores=0.0)
    with pytest.raises(ValueError, match="external_cores must be a finite number >= 0"):
        HostCpu(cores=2.0, external_cores=-1.0)
    with pytest.raises(ValueError, match="per_token_s must be a finite number >= 0"):
        ProcessCpu(per_token_s=float("nan"))
    with pytest.raises(ValueError, match="host_cpu: .*unexpected keyword"):
        HostCpu.from_json({"cores_": 2})


def test_a_window_reads_this_process_from_proc():
    window = Window({"self": os.getpid()})
    sum(i * i for i in range(300_000))
    got = window.end()
    assert got["cpu_s"]["self"] >= 0.0 and 0.0 <= got["share"]["self"] <= 1.0
    assert got["external_cores"] >= 0.0 and got["wall_s"] > 0


def test_a_requests_own_cpu_lengthens_its_workers_next_step():
    """Per request (the KV sent or received, the RPCs): prefill 0.25 s, decode 0.125 s. r0's first token at
    0.25; its KV in, the decode worker's next step carries 0.125: 0.25 -> 0.4375, then 0.5. r1 (at 0.25)
    prefills in the step that carries r0's 0.25: first token at 0.75, its decode steps end at 0.9375 and 1.0.
    Colocated, no KV moves: nothing is added."""
    from dataclasses import replace

    base = _profile()
    profile = replace(base, prefill=replace(base.prefill, per_request_s=0.25),
                      decode=replace(base.decode, per_request_s=0.125))
    result = simulate(_requests(0.0, 0.25), ClusterSpec(), profile)
    assert [o.chunk_times for o in result.outputs] == [[0.25, 0.4375, 0.5], [0.75, 0.9375, 1.0]]
    colocated = simulate(_requests(0.0), ClusterSpec(prefill_workers=0, colocated=True), profile)
    assert colocated.outputs[0].chunk_times == simulate(_requests(0.0), ClusterSpec(prefill_workers=0, colocated=True),
                                                        base).outputs[0].chunk_times
