"""`python -m pdserve.benchmarks.tiers --quick` runs end to end and reports a positive number for every measure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CEILINGS = [
    "memcpy_numpy_gbps",
    "memcpy_torch_gbps",
    "matmul_jax_gflops",
    "matmul_torch_gflops",
    "grpc_loopback_gbps_tiny",
]
TIERS = ["prefill", "decode", "kv-transfer"]


def test_quick_run_reports_every_tier_and_ceiling(tmp_path, tiny_model):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "tiny-llama").symlink_to(tiny_model("llama"))  # the session's tiny llama, not a new one
    out = tmp_path / "tiers.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.benchmarks.tiers", "--quick", "--json", str(out), "--cache-dir", str(cache)],
        cwd=REPO,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,  # ~10 s alone; generous for a busy 2-core machine
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].split() == ["model", "tier", "measure", "value", "ceiling", "ratio"]

    result = json.loads(out.read_text())
    assert result["models"] == ["tiny"]
    for name in CEILINGS:
        assert result["ceilings"][name] > 0, name
    rows = [r for r in result["rows"] if r["model"] == "tiny"]
    assert {r["tier"] for r in rows} == set(TIERS)
    for row in rows:
        assert row["value"] > 0 and row["ceiling"] > 0 and row["ratio"] > 0, row
