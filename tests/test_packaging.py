"""The wheel installs one import package, `pdserve`, and declares floors the generated wire code accepts."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = {"pdserve": "proto/pdserve", "pdserve.server": "server", "pdserve.kvcache": "kvcache",
                "pdserve.benchmarks": "benchmarks"}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _floor(requirements: list[str], name: str) -> Version:
    for line in requirements:
        req = Requirement(line)
        if req.name == name:
            floors = [Version(s.version) for s in req.specifier if s.operator in (">=", "==")]
            assert floors, f"{name} has no floor in pyproject.toml"
            return max(floors)
    raise AssertionError(f"{name} is not a dependency")


def test_package_map_lists_every_python_package_in_the_repo():
    """A new sub-package folder must be added to [tool.setuptools] packages, or the wheel silently lacks it."""
    tool = _pyproject()["tool"]["setuptools"]
    assert tool["package-dir"] == PACKAGE_DIRS
    found = set()
    for name, folder in PACKAGE_DIRS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *rel)))
    assert found == set(tool["packages"])


def test_floors_match_the_generated_code():
    deps = _pyproject()["project"]["dependencies"]
    pb2 = (ROOT / "proto/pdserve/v1/worker_pb2.py").read_text()
    grpc_stub = (ROOT / "proto/pdserve/v1/worker_pb2_grpc.py").read_text()
    protobuf_needed = Version(re.search(r"Protobuf Python Version: ([\d.]+)", pb2).group(1))
    grpc_needed = Version(re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", grpc_stub).group(1))
    assert _floor(deps, "protobuf") >= protobuf_needed
    for name in ("grpcio", "grpcio-health-checking", "grpcio-reflection"):
        assert _floor(deps, name) >= grpc_needed, name


def test_workers_do_not_need_the_coordinator_extra():
    """fastapi, pydantic, uvicorn, jinja2 and tritonclient belong to the coordinator extra only."""
    project = _pyproject()["project"]
    base = {Requirement(r).name for r in project["dependencies"]}
    coordinator = {Requirement(r).name for r in project["optional-dependencies"]["coordinator"]}
    assert {"fastapi", "pydantic", "uvicorn", "jinja2", "tritonclient"} <= coordinator
    assert not base & coordinator


@pytest.mark.timeout(300)
def test_wheel_has_only_pdserve_at_top_level(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(ROOT)], check=True)
    wheel = next(tmp_path.glob("pdserve-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"pdserve"}
    for needed in ("pdserve/v1/worker_pb2.py", "pdserve/server/cli.py", "pdserve/kvcache/layout.py",
                   "pdserve/benchmarks/tiers.py", "pdserve/server/model/default/config.json",
                   "pdserve/server/plan/catalog.json"):
        assert needed in names, needed
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "pdserve = pdserve.server.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_vllm_extra_leaves_torch_to_vllm():
    """vLLM pins its own torch: the vllm extra installs vLLM and nothing that pins torch."""
    extras = _pyproject()["project"]["optional-dependencies"]
    names = {Requirement(r).name for r in extras["vllm"]}
    assert names == {"vllm"}
    assert "torch" not in " ".join(extras["vllm"])


def test_the_server_never_imports_the_benchmarks():
    """`pdserve bench` is an entry point (pyproject.toml `pdserve.commands`) that the CLI loads only when it runs:
    no module of the server names the benchmarks, and building the CLI imports none of them."""
    import ast
    import gc

    # CPython 3.11 raises "SystemError: AST constructor recursion depth mismatch" when a garbage collection runs
    # finalizers in the middle of ast.parse (CI, after the suite's servers: their transports' finalizers log):
    # the garbage collected first, and none while parsing.
    gc.collect()
    gc.disable()
    try:
        trees = {path: ast.parse(path.read_text()) for path in (ROOT / "server").rglob("*.py")}
    finally:
        gc.enable()
    for path, tree in trees.items():
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.startswith("pdserve.benchmarks") for n in names), path
        for node in ast.walk(tree):  # nor names one for importlib (the plan's measuring commands: entry points)
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert not node.value.startswith("pdserve.benchmarks"), (path, node.value)
    entries = _pyproject()["project"]["entry-points"]
    assert entries["pdserve.commands"] == {"bench": "pdserve.benchmarks.bench:main"}
    assert entries["pdserve.plan.commands"] == {"profile": "pdserve.benchmarks.plan.measure:main",
                                                "validate": "pdserve.benchmarks.plan.validate:main"}
    code = ("import sys; from pdserve.server import cli; cli.build_parser(); "
            "print(sorted(m for m in sys.modules if m.startswith('pdserve.benchmarks')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_pdserve_bench_runs_the_load_generator():
    """This install registers the entry point (a stale one: `pip install -e .` again) and `pdserve bench`
    hands its flags to the load generator's own parser."""
    out = subprocess.run([sys.executable, "-m", "pdserve.server.cli", "bench", "--help"], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: pdserve bench") and "--request-rate" in out.stdout
