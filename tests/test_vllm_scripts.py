"""The .venv-vllm script runner (`tests/vllm_scripts.py`) gives what `subprocess.run` of a fresh interpreter gives:
the script's stdin, stdout, stderr, exit code and environment, and nothing one script did is seen by the next."""

from __future__ import annotations

import os
import signal

from tests.vllm_python import require_vllm_python
from tests.vllm_scripts import run_vllm_script

require_vllm_python()


def test_a_script_reads_its_stdin_and_env_and_its_exit_code_and_streams_come_back(tmp_path):
    code = ("import os, sys, vllm; print(sys.stdin.read().upper()); print('to stderr', file=sys.stderr); "
            "print(os.environ.get('ONLY_HERE'), os.getcwd()); sys.exit(3)")
    run = run_vllm_script(code=code, stdin="abc", env={**os.environ, "ONLY_HERE": "yes"}, cwd=tmp_path, timeout=300)
    assert (run.returncode, run.stdout, run.stderr) == (3, f"ABC\nyes {tmp_path}\n", "to stderr\n")


def test_a_script_that_raises_or_dies_by_a_signal_fails_as_a_fresh_process_would(tmp_path):
    raised = run_vllm_script(code="raise ValueError('no such thing')", timeout=300)
    assert raised.returncode == 1 and raised.stderr.rstrip().endswith("ValueError: no such thing")
    killed = run_vllm_script(code=f"import os; os.kill(os.getpid(), {int(signal.SIGILL)})", timeout=300)
    assert killed.returncode == -signal.SIGILL
    script = tmp_path / "script.py"
    script.write_text("import sys; print(sys.argv[0], sys.path[0]); raise SystemExit('bad input')")
    run = run_vllm_script(file=script, timeout=300)
    assert (run.returncode, run.stdout, run.stderr) == (1, f"{script} {tmp_path}\n", "bad input\n")


def test_nothing_a_script_does_reaches_the_next():
    first = run_vllm_script(code="import os, sys; sys.modules['vllm'].LEFT = 1; os.environ['LEFT'] = '1'; print('set')",
                            env={k: v for k, v in os.environ.items() if k != "LEFT"}, timeout=300)
    assert (first.returncode, first.stdout) == (0, "set\n"), first.stderr
    second = run_vllm_script(code="import os, vllm; print(hasattr(vllm, 'LEFT'), 'LEFT' in os.environ)",
                             env={k: v for k, v in os.environ.items() if k != "LEFT"}, timeout=300)
    assert (second.returncode, second.stdout) == (0, "False False\n"), second.stderr
