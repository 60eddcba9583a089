"""`plan validate`'s table and README splice (the real runs are `pdserve plan validate` itself)."""

from __future__ import annotations

import pytest

from pdserve.benchmarks.plan.validate import END, MARK, table, write_readme


def _row(pred: float, meas: float) -> dict:
    stats = lambda v: {"median": v, "p99": 2 * v}  # noqa: E731
    return {"shape": "short", "input_len": 64, "output_len": 32, "rate": 2.5,
            "predicted": {"ttft_ms": stats(pred), "tpot_ms": stats(pred), "completed": 10},
            "measured": {"ttft_ms": stats(meas), "tpot_ms": stats(meas), "completed": 10},
            "cores": {"coordinator": 0.5, "prefill-0": 0.25, "decode-0": 1.0}, "load_avg": 2.0}


def test_table_marks_what_misses_25_percent():
    text = table([_row(120.0, 100.0), _row(130.0, 100.0)])
    assert "| short (64 in, 32 out) | 2.50 | 120.0 / 100.0 | +20% |" in text
    assert "130.0 / 100.0 | +30% ✗" in text
    assert "| 0.50 / 0.25 / 1.00 | - | 2.0 |" in text  # no other load recorded: -
    assert text.endswith("3 of 6 figures within 25% (✗: outside).")


def test_readme_splice(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"head\n{MARK}\nold\n{END}\ntail\n")
    write_readme(readme, "new table")
    assert readme.read_text() == f"head\n{MARK}\nnew table\n{END}\ntail\n"
    readme.write_text("no markers")
    with pytest.raises(ValueError, match="markers"):
        write_readme(readme, "x")


def test_predict_only_puts_each_row_on_its_host(tmp_path):
    """--predict-only simulates each recorded row on the host it ran on: 2 cores of which another user kept 1
    busy predict what 1 core of its own does; --host-cores 0 gives each worker cores of its own."""
    import json

    from pdserve.server.plan.profile import DecodeCost, HandoffCost, PrefillCost, Profile
    from pdserve.benchmarks.plan.validate import build_parser, _predict_again

    profile = Profile("scripted", "m", PrefillCost(0.01, 1e-4), DecodeCost(0.004, 1e-4), HandoffCost(0.0, 1e9, 0),
                      4096, "scripted")
    profile.save(tmp_path / "p.json")
    row = {"shape": "short", "input_len": 64, "output_len": 8, "rate": 20.0, "load_avg": 1.0,
           "measured": {"ttft_ms": {"median": 10.0, "p99": 20.0}, "tpot_ms": {"median": 5.0}, "completed": 1},
           "cores": {}}
    rows = [{**row, "host_cores": 2.0, "external_cores": 1.0}, {**row, "host_cores": 1.0, "external_cores": 0.0}]
    (tmp_path / "validation.json").write_text(json.dumps({"rows": rows}))

    def predicted(*flags: str) -> list[dict]:
        args = build_parser().parse_args(["--profile", str(tmp_path / "p.json"), "--out", str(tmp_path),
                                          "--predict-only", "--duration", "2", *flags])
        assert _predict_again(args, profile, 512) == 0
        return [r["predicted"] for r in json.loads((tmp_path / "validation.json").read_text())["rows"]]

    shared, alone = predicted(), predicted("--host-cores", "0")
    assert shared[0]["ttft_ms"] == shared[1]["ttft_ms"] and shared[0]["tpot_ms"] == shared[1]["tpot_ms"]
    assert alone[0]["ttft_ms"] == alone[1]["ttft_ms"]
    assert shared[0]["tpot_ms"]["median"] > alone[0]["tpot_ms"]["median"]  # sharing one core stretches the steps
