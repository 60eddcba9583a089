"""The hardware catalog: the shipped one parses with every required field; a bad entry is refused by
field; the roofline projection is the formula of roofline.py's docstring."""

from __future__ import annotations

import copy
import json

import pytest

from pdserve.server.plan import catalog
from pdserve.server.plan.catalog import CatalogError
from pdserve.server.plan.profile import DecodeCost, HandoffCost, PrefillCost, Profile
from pdserve.server.plan.roofline import DEFAULT, DoesNotFit, Efficiency, chips_for, efficiency_of, project


def _doc() -> dict:
    from importlib import resources

    return json.loads(resources.files("pdserve.server.plan").joinpath("catalog.json").read_text())


def test_the_shipped_catalog_has_every_accelerator_the_issue_names():
    c = catalog.load()
    assert set(c.accelerators) == {"H100", "H200", "B200", "L4", "TPU v5e", "TPU v6e", "TPU v7"}
    h200 = c.accelerator("H200")
    assert h200.flops("bf16") == 989e12 and h200.flops("fp4") is None and h200.hbm_bytes_per_s == 4.8e12
    assert c.accelerator("B200").flops("fp4") == 9000e12
    assert c.accelerator("TPU v7").price_per_hour is None  # unpublished: plans on it need --price
    assert c.date and all(e["sources"] for e in _doc()["accelerators"])
    assert c.model("llama-3.1-8b").kv_bytes_per_token("bf16") == 2 * 32 * 8 * 128 * 2


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["accelerators"][0].pop("hbm_gb_per_s"), "accelerator 'H100': field 'hbm_gb_per_s' is missing"),
    (lambda d: d["accelerators"][1].update(hbm_gib=-1), "accelerator 'H200': field 'hbm_gib' must be a number > 0"),
    (lambda d: d["accelerators"][2]["peak_tflops"].pop("bf16"), "accelerator 'B200' peak_tflops: field 'bf16'"),
    (lambda d: d["accelerators"][3]["links"].pop("network_gb_per_s"), "accelerator 'L4' links: field 'network_gb_per_s'"),
    (lambda d: d["accelerators"][0].update(kind="fpga"), "field 'kind' must be gpu, tpu or cpu"),
    (lambda d: d["accelerators"][0].update(price_per_chip_hour="cheap"), "field 'price_per_chip_hour' must be a number"),
    (lambda d: d.pop("date"), "field 'date' is missing"),
    (lambda d: d["models"][0].pop("layers"), "model 'llama-3.1-8b': field 'layers' is missing"),
])
def test_bad_entries_are_refused_naming_the_field(edit, message):
    doc = copy.deepcopy(_doc())
    edit(doc)
    with pytest.raises(CatalogError) as e:
        catalog.parse(doc)
    assert message in str(e.value)


def test_user_catalog_file(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps(_doc()))
    assert catalog.load(tmp_path / "c.json").accelerator("L4").price_per_hour == 0.71
    with pytest.raises(CatalogError, match="not JSON"):
        (tmp_path / "bad.json").write_text("{")
        catalog.load(tmp_path / "bad.json")


def test_projection_is_the_roofline_formula():
    c = catalog.load()
    h100, m = c.accelerator("H100"), c.model("llama-3.1-8b")
    eff = Efficiency(0.5, 0.5, 0.001, 0.001, 0.0, 0.0)
    p = project(h100, m, "bf16", "fp8", eff)
    flops, bw = 989e12 * 0.5, 3350e9 * 0.5
    weights = 8.03e9 * 2
    assert p.chips == 1
    assert p.decode.fixed_s == pytest.approx(0.001 + weights / bw)
    assert p.decode.per_seq_s == pytest.approx(2 * 8.03e9 / flops)
    assert p.decode.per_context_token_s == pytest.approx(2 * 32 * 8 * 128 / bw + 4 * 32 * 4096 / flops)
    assert p.kv_cache_tokens == int((0.9 * 80 * 2**30 - weights) // (2 * 32 * 8 * 128))
    assert p.handoff.bytes_per_s == 50e9 and p.handoff.kv_bytes_per_token == 2 * 32 * 8 * 128


def test_chips_follow_the_weights():
    c = catalog.load()
    assert chips_for(c.accelerator("TPU v5e"), c.model("llama-3.1-8b"), "bf16") == 2  # 16 GB > 0.6 x 16 GiB
    assert chips_for(c.accelerator("TPU v5e"), c.model("llama-3.1-8b"), "fp8") == 1
    with pytest.raises(DoesNotFit, match="no fp4 path"):
        project(c.accelerator("H100"), c.model("llama-3.1-8b"), "fp4", "fp8", DEFAULT)


def test_efficiency_from_a_measured_profile():
    p = Profile("gpu", "m", PrefillCost(0.01, 2e-9), DecodeCost(0.002, 0.0, 1e-9), HandoffCost(0.001, 1e9, 1000), 100,
                notes={"peak": {"flops": 1e18, "bytes_per_s": 2e12}, "model_shape": {"params": 1e8}})
    e = efficiency_of(p)
    assert e.compute == pytest.approx(2e8 / 2e-9 / 1e18) and e.bandwidth == pytest.approx(1000 / 1e-9 / 2e12)
    assert efficiency_of(Profile("x", "m", p.prefill, p.decode, p.handoff, 100)) is None
