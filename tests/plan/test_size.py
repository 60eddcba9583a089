"""`pdserve plan size`: the search on a small workload, the SLO checks, and the overlay it writes (rendered
and validated as tests/deploy validates deploy/)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdserve.server.plan import catalog
from pdserve.server.plan.overlay import write_overlay
from pdserve.server.plan.size import Plan, Slo, dtype_choices, pairings, verdict


def _plan(**kw) -> Plan:
    base = dict(pairing="gpu+gpu", prefill_hw="H100", decode_hw="H100", prefill_weights="fp8", decode_weights="fp8",
                kv_dtype="fp8", prefill_workers=2, decode_workers=3, chips_per_prefill=1, chips_per_decode=1,
                dollars_per_hour=14.95, dollars_per_mtok=0.1, goodput=10.0, goodput_per_chip=2.0, attainment=0.95,
                ttft_p99_ms=500.0, tpot_p99_ms=20.0, itl_p99_ms=30.0, kv_usage=0.4, prefill_utilisation=0.5,
                decode_utilisation=0.6, meets=True)
    return Plan(**{**base, **kw})


def test_slo_of_zero_is_refused_by_name():
    with pytest.raises(ValueError, match="--slo-ttft-ms must be > 0, got 0"):
        Slo(0.0, 50.0)
    with pytest.raises(ValueError, match="--attainment must be in"):
        Slo(100.0, 50.0, attainment=1.5)


def test_verdict_names_the_tier_to_grow():
    slo = Slo(1000.0, 50.0)
    ok = {"slo_attainment": 0.95, "failed": 0, "ttft_ms": {"p90": 900}, "tpot_ms": {"p90": 40}, "itl_ms": {"p99": 60}}
    assert verdict(ok, slo) == ""
    assert verdict({**ok, "slo_attainment": 0.5, "ttft_ms": {"p90": 2000}}, slo) == "prefill"
    assert verdict({**ok, "slo_attainment": 0.5, "tpot_ms": {"p90": 80}}, slo) == "decode"
    assert verdict({**ok, "slo_attainment": 0.5, "ttft_ms": {"p90": 2000}, "tpot_ms": {"p90": 80}}, slo) == "both"
    assert verdict(ok, Slo(1000.0, 50.0, itl_p99_ms=50.0)) == "decode"


def test_pairings_cover_the_issues_kinds_and_skip_unpriced_hardware():
    kinds = {(p.kind, p.prefill.name if p.prefill else None, p.decode.name) for p in pairings(catalog.load(), None)}
    assert ("tpu+gpu", "TPU v6e", "H100") in kinds and ("gpu+gpu", "B200", "B200") in kinds
    assert ("colocated-gpu", None, "L4") in kinds and ("colocated-tpu", None, "TPU v5e") in kinds
    assert not any("TPU v7" in (k[1] or "", k[2]) for k in kinds)  # no published price
    b200 = next(p for p in pairings(catalog.load(), ["B200"]) if p.kind == "gpu+gpu")
    assert ("fp4", "fp4", "fp8") in dtype_choices(b200)


@pytest.mark.parametrize("colocated", [False, True])
def test_the_overlay_renders_and_validates(tmp_path, colocated):
    from tests.deploy.manifests import DEPLOY, named, render
    from tests.deploy.test_render import K8S_VERSIONS, validate

    plan = _plan(prefill_workers=0, prefill_hw=None, pairing="colocated-gpu") if colocated else _plan()
    out = DEPLOY / "overlays" / f".plan-test-{tmp_path.name}"
    try:
        write_overlay(out, plan, Slo(1000.0, 50.0))
        objects = render(out)
        for obj in objects:
            for version in K8S_VERSIONS:
                validate(obj, version)
        decode_hpa = named(objects, "HorizontalPodAutoscaler", "pdserve-decode")
        assert (decode_hpa["spec"]["minReplicas"], decode_hpa["spec"]["maxReplicas"]) == (3, 6)
        assert decode_hpa["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == "500m"  # 0.4 x 1.25
        assert named(objects, "Deployment", "pdserve-decode")["spec"]["replicas"] == 3
        if colocated:
            assert not [o for o in objects if o["kind"] in ("Deployment", "HorizontalPodAutoscaler")
                        and o["metadata"]["name"] == "pdserve-prefill"]
        else:
            hpa = named(objects, "HorizontalPodAutoscaler", "pdserve-prefill")
            assert hpa["spec"]["minReplicas"] == 2 and hpa["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == "0.5"
            assert named(objects, "Deployment", "pdserve-prefill")["spec"]["replicas"] == 2
    finally:
        for f in out.glob("*"):
            f.unlink()
        out.rmdir()


def test_size_end_to_end_on_a_small_workload(tmp_path):
    """One accelerator, a light load: every pairing on it gets a plan meeting the SLOs, cheapest first."""
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.server.cli", "plan", "size", "--hardware", "L4", "--model-shape",
         "qwen2.5-0.5b", "--input-len", "512", "--output-len", "32", "--request-rate", "4", "--duration", "5",
         "--slo-ttft-ms", "1000", "--slo-tpot-ms", "50", "--json"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    plans = json.loads(out.stdout)
    assert {p["pairing"] for p in plans} == {"gpu+gpu", "colocated-gpu"}
    assert all(p["meets"] for p in plans)
    costs = [p["dollars_per_mtok"] for p in plans]
    assert costs == sorted(costs)
    colocated = next(p for p in plans if p["pairing"] == "colocated-gpu")
    assert colocated["prefill_workers"] == 0 and colocated["ratio"] == "colocated"
