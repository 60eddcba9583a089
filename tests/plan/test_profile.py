"""Profile files: read back what was written; a wrong field is refused by name."""

from __future__ import annotations

import json

import pytest

from pdserve.server.plan.profile import DecodeCost, HandoffCost, PrefillCost, Profile, ProfileError


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


def _with_dtypes() -> Profile:
    from pdserve.server.plan.contention import HostCpu, ProcessCpu
    from pdserve.server.plan.profile import DtypeRow

    return Profile("cpu", "tiny", PrefillCost(0.01, 1e-4), DecodeCost(0.005, 2e-4), HandoffCost(0.002, 1e9, 4096),
                   65536, host_cpu=HostCpu(prefill_threads=1.5, coordinator=ProcessCpu(0.002, 1e-4)),
                   dtypes="auto/auto", decode_dtypes={"auto/int8": DtypeRow(DecodeCost(0.004, 1e-4), 1056, 131072)})


def test_decode_rows_per_dtype_pair(tmp_path):
    p = _with_dtypes()
    p.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == p
    assert p.measured_dtypes == ["auto/auto", "auto/int8"]
    assert p.with_dtypes(None, None) is p and p.with_dtypes("auto", "auto") is p
    q = p.with_dtypes(None, "int8")
    assert (q.decode, q.handoff.kv_bytes_per_token, q.kv_cache_tokens, q.dtypes) == (
        DecodeCost(0.004, 1e-4), 1056, 131072, "auto/int8")
    assert q.prefill == p.prefill and q.host_cpu == p.host_cpu
    with pytest.raises(ProfileError, match=r"measured decode at weight/KV dtypes auto/auto, auto/int8, not "
                                           r"int8/auto: .*--decode-dtypes auto/auto,auto/int8,int8/auto"):
        p.with_dtypes("int8", None)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(dtypes="auto"), 'dtypes must be "WEIGHT/KV"'),
    (lambda d: d["decode_dtypes"]["auto/int8"].pop("kv_cache_tokens"), "decode_dtypes.auto/int8: field 'kv_cache_tokens'"),
    (lambda d: d["decode_dtypes"].update(int8={}), r"decode_dtypes.int8: a \"WEIGHT/KV\" key"),
    (lambda d: d["decode_dtypes"]["auto/int8"].update(kv_bytes_per_token=0), "kv_bytes_per_token and kv_cache_tokens"),
    (lambda d: d["host_cpu"]["coordinator"].update(per_token_s=-1), "host_cpu: per_token_s must be"),
])
def test_bad_dtype_rows_and_host_cpu_are_named(tmp_path, edit, message):
    doc = _with_dtypes().to_json()
    edit(doc)
    (tmp_path / "p.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=message):
        Profile.load(tmp_path / "p.json")


def test_decode_dtype_pairs_are_the_decode_workers_choices():
    import argparse

    from pdserve.benchmarks.plan.measure import dtype_args, parse_dtype_pairs

    assert parse_dtype_pairs("auto/auto, auto/int8,int8/fp8_e4m3") == ["auto/auto", "auto/int8", "int8/fp8_e4m3"]
    assert dtype_args("int8/fp8_e4m3") == ["--weight-dtype", "int8", "--kv-dtype", "fp8_e4m3"]
    for bad, message in (("auto", "give WEIGHT/KV"), ("int4/auto", "WEIGHT one of"), ("auto/int4", "KV one of"),
                         ("auto/auto,auto/auto", "twice"), ("", "at least one")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            parse_dtype_pairs(bad)
