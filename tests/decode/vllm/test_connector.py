"""pdserve's vLLM connector with two tensor-parallel ranks (`connector_twin.py`, run in .venv-vllm)."""

from __future__ import annotations

from pathlib import Path

from tests.vllm_python import require_vllm_python
from tests.vllm_scripts import run_vllm_script

require_vllm_python()

TWIN = Path(__file__).with_name("connector_twin.py")


def test_each_rank_loads_its_kv_heads_and_every_stage_is_released():
    run = run_vllm_script(file=TWIN, timeout=600, cwd=Path(__file__).resolve().parents[3])
    assert run.returncode == 0, f"{TWIN.name} failed:\n{run.stdout[-3000:]}\n{run.stderr[-5000:]}"
    assert run.stdout.splitlines()[-1] == "ok: 7 checks"
