"""benchmarks.engine.moe_layer at a tiny size: a row per path and dtype, a time per batch, the paths' layers computing
the same step."""

from __future__ import annotations

import argparse

import torch

from pdserve.benchmarks.engine import moe_layer


def test_a_tiny_run_prints_every_path_at_every_batch(capsys):
    assert moe_layer.main(["--hidden", "64", "--expert-size", "64", "--batches", "1", "5", "--reps", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| float") or
            line.startswith("| bfloat")]
    paths = {line.split("|")[2].strip() for line in rows}
    assert {"loop (plain)", "grouped", "fused", "loop (int8)"} <= paths
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")][2:]
        assert len(cells) == 2 and all(float(c) > 0 for c in cells)


def test_the_paths_compute_the_same_step():
    args = argparse.Namespace(hidden=64, expert_size=64, experts=8, top_k=2)
    layers = moe_layer.paths(args, torch.float32)
    assert layers["grouped"].grouped and not layers["loop (plain)"].grouped and layers["fused"].cpu_fused
    x = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = layers["loop (plain)"](x)
        for name, mlp in layers.items():
            tol = 5e-2 if "int8" in name else 1e-4
            assert ((mlp(x) - want).abs().max() / want.abs().max()).item() < tol, name
