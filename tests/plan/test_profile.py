"""Profile files: read back what was written; a wrong field is refused by name."""

from __future__ import annotations

import json

import pytest

from pdserve.benchmarks.plan.profile import DecodeCost, HandoffCost, PrefillCost, Profile, ProfileError


def _profile() -> Profile:
    return Profile("cpu", "tiny", PrefillCost(0.01, 1e-4, 1e-8), DecodeCost(0.005, 2e-4, 1e-7, 1e-4),
                   HandoffCost(0.002, 1e9, 4096), 65536, ttft_overhead_s=0.003)


def test_round_trip(tmp_path):
    p = _profile()
    p.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == p
    assert p.prefill.step_seconds(128, 1000) == 0.01 + 128e-4 + 1000e-8
    assert p.handoff.seconds(1000) == 0.002 + 1000 * 4096 / 1e9


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["handoff"].pop("bytes_per_s"), "bytes_per_s"),
    (lambda d: d["handoff"].update(bytes_per_s=0), "handoff.bytes_per_s must be > 0"),
    (lambda d: d["decode"].update(fixed_s=-1), "decode.fixed_s must be a finite number >= 0, got -1"),
    (lambda d: d.pop("kv_cache_tokens"), "field 'kv_cache_tokens' is missing"),
    (lambda d: d.update(kv_cache_tokens=0), "kv_cache_tokens must be >= 1"),
])
def test_bad_fields_are_named(tmp_path, edit, message):
    doc = _profile().to_json()
    edit(doc)
    (tmp_path / "p.json").write_text(json.dumps(doc))
    with pytest.raises(ProfileError, match=message):
        Profile.load(tmp_path / "p.json")


def test_missing_file_says_how_to_make_one(tmp_path):
    with pytest.raises(ProfileError, match="pdserve plan profile --out"):
        Profile.load(tmp_path / "none.json")
