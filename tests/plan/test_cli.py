"""`pdserve plan` is the server's command: simulate and size run without the benchmarks; profile and validate,
which drive a live cluster with the load generator, come from the benchmarks through entry points."""

from __future__ import annotations

import subprocess
import sys

from pdserve.server.plan import cli
from pdserve.server.plan.profile import DecodeCost, HandoffCost, PrefillCost, Profile


def _plan(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.server.cli", "plan", *argv], capture_output=True, text=True,
                          timeout=120)


def test_no_command_prints_the_commands_and_an_unknown_one_is_named():
    out = _plan()
    assert out.returncode == 2 and out.stdout.startswith("`pdserve plan`: profile this machine's tiers")
    out = _plan("bogus")
    assert out.returncode == 2
    assert out.stderr.splitlines()[-1] == ("pdserve plan: unknown command 'bogus'; choose one of profile, simulate, "
                                           "size, validate")
    assert _plan("--help").returncode == 0


def test_simulate_imports_no_benchmark(tmp_path):
    Profile("cpu", "tiny", PrefillCost(0.25, 0.0), DecodeCost(0.0625, 0.0), HandoffCost(0.0, 1e30, 0), 4096,
            "scripted").save(tmp_path / "p.json")
    code = ("import sys; from pdserve.server import cli; code = cli.main(['plan', 'simulate', '--profile', "
            f"{str(tmp_path / 'p.json')!r}, '--input-len', '16', '--output-len', '3', '--request-rate', '8', "
            "'--num-prompts', '4', '--json']); "
            "print(code, sorted(m for m in sys.modules if m.startswith('pdserve.benchmarks')), file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stderr.splitlines()[-1] == "0 []"


def test_the_measuring_commands_are_the_benchmarks_entry_points():
    """This install registers them (a stale one: `pip install -e .` again); their own parsers answer."""
    for name in ("profile", "validate"):
        out = _plan(name, "--help")
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith(f"usage: pdserve plan {name}")


def test_a_missing_entry_point_says_to_install_again(monkeypatch):
    import importlib.metadata

    import pytest

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **_: [])
    with pytest.raises(SystemExit, match=r"pdserve plan profile: .* install pdserve again"):
        cli.main(["profile", "--help"])
