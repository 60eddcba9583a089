"""server/decode/vllm/probe.py: whether an interpreter runs vLLM's kernels here, and if not, why."""

from __future__ import annotations

import sys

import pytest

from pdserve.server.decode.vllm.probe import vllm_problem
from tests.vllm_python import VLLM_PYTHON


def test_an_interpreter_without_vllm_names_the_flag_and_the_make_target():
    problem = vllm_problem(sys.executable)  # the dev venv: pdserve's torch, no vLLM
    assert problem.startswith(f"{sys.executable} cannot import vLLM (No module named 'vllm')")
    assert "--decode-python" in problem and "make vllm-venv" in problem
    assert "does not exist" in vllm_problem("/nonexistent/bin/python")


def test_a_build_the_cpu_cannot_execute_is_named_for_the_cpu(tmp_path):
    sigill = tmp_path / "python"
    sigill.write_text("#!/bin/sh\nkill -ILL $$\n")  # what a library built for missing instructions does
    sigill.chmod(0o755)
    problem = vllm_problem(str(sigill))
    assert "instructions this CPU lacks" in problem and "illegal instruction" in problem
    assert "--decode-engine native" in problem


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm (make vllm-venv); make test builds it")
def test_the_vllm_venv_runs_its_kernels_here():
    assert vllm_problem(str(VLLM_PYTHON)) is None
