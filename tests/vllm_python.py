"""The .venv-vllm interpreter the vLLM tests run (vLLM pins its own dependencies, so it lives apart)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"


def require_vllm_python() -> None:
    """Skips the module without .venv-vllm; under `make test` (PDSERVE_REQUIRE_VLLM=1) fails it instead.
    Where vLLM is installed but cannot run on this CPU, skips it, saying why and what CPU it needs."""
    if not VLLM_PYTHON.exists():
        if os.environ.get("PDSERVE_REQUIRE_VLLM"):
            raise RuntimeError(f"{VLLM_PYTHON} is missing: run `make vllm-venv` (make test does)")
        pytest.skip("no .venv-vllm (make vllm-venv); make test runs these", allow_module_level=True)
    from pdserve.server.decode.vllm.probe import vllm_problem

    problem = vllm_problem(str(VLLM_PYTHON))
    if problem is not None:
        pytest.skip(problem, allow_module_level=True)
