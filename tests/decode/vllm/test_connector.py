"""pdserve's vLLM connector with two tensor-parallel ranks (`connector_twin.py`, run in .venv-vllm)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.vllm_python import VLLM_PYTHON, require_vllm_python

require_vllm_python()

TWIN = Path(__file__).with_name("connector_twin.py")


def test_each_rank_loads_its_kv_heads_and_every_stage_is_released():
    run = subprocess.run([str(VLLM_PYTHON), str(TWIN)], capture_output=True, text=True, timeout=600,
                         cwd=Path(__file__).resolve().parents[3])
    assert run.returncode == 0, f"{TWIN.name} failed:\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    assert run.stdout.splitlines()[-1] == "ok: 7 checks"
