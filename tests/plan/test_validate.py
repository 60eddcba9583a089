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
    assert "| 0.50 / 0.25 / 1.00 | 2.0 |" in text
    assert text.endswith("3 of 6 figures within 25% (✗: outside).")


def test_readme_splice(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"head\n{MARK}\nold\n{END}\ntail\n")
    write_readme(readme, "new table")
    assert readme.read_text() == f"head\n{MARK}\nnew table\n{END}\ntail\n"
    readme.write_text("no markers")
    with pytest.raises(ValueError, match="markers"):
        write_readme(readme, "x")
