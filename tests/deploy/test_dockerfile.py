"""deploy/Dockerfile, checked statically (no container engine here): stages, user, health check, contents."""

from __future__ import annotations

import re
import tomllib

import pytest
from dockerfile_parse import DockerfileParser

from tests.deploy.manifests import DEPLOY, ROOT

FINAL = ["coordinator", "prefill", "decode-vllm", "decode"]
TIER = {"decode-vllm": "decode"}  # the CLI role a final stage runs, where it differs from the stage's name
COMPILERS = re.compile(r"\b(build-essential|gcc|g\+\+|clang|make|cmake|rustc|cargo)\b")


def stages() -> dict[str, list[dict]]:
    """Instructions by stage name, in order (FROM ... AS name opens a stage)."""
    parser = DockerfileParser(path=str(DEPLOY / "Dockerfile"))
    out: dict[str, list[dict]] = {}
    current = None
    for ins in parser.structure:
        if ins["instruction"] == "FROM":
            current = ins["value"].split(" AS ")[-1].strip()
            out[current] = []
        if current is not None:
            out[current].append(ins)
    return out


def values(stage: list[dict], instruction: str) -> list[str]:
    return [i["value"] for i in stage if i["instruction"] == instruction]


def ancestry(all_stages: dict[str, list[dict]], name: str) -> list[str]:
    """name, its parent stage, ... up to the stage built FROM an external image."""
    chain = [name]
    while True:
        base = values(all_stages[chain[-1]], "FROM")[0].split(" AS ")[0].strip()
        if base not in all_stages:
            return chain
        chain.append(base)


def test_stages_and_targets():
    all_stages = stages()
    assert list(all_stages) == ["build", "venv-coordinator", "venv-prefill", "venv-decode", "venv-decode-vllm",
                                "runtime", *FINAL]
    # The final stages are the last ones, so a plain `docker build` gives a complete image too.
    for name in FINAL:
        assert ancestry(all_stages, name) == [name, "runtime"]
        copies = values(all_stages[name], "COPY")
        assert copies == [f"--from=venv-{name} /opt/pdserve /opt/pdserve"]


@pytest.mark.parametrize("name", FINAL)
def test_final_stage_runs_as_non_root_with_a_health_check(name):
    all_stages = stages()
    users = values(all_stages[name], "USER")
    assert users == ["10001:10001"]
    (healthcheck,) = values(all_stages[name], "HEALTHCHECK")
    assert healthcheck.endswith('CMD ["/opt/pdserve/bin/python", "/usr/local/bin/pdserve-healthcheck"]')
    # The health check asks the port this tier listens on by default (server/cli.py).
    from pdserve.server.cli import build_parser

    default_port = build_parser().parse_args([TIER.get(name, name), "--model", "/m"]).port
    env = " ".join(values(all_stages[name], "ENV") + values(all_stages["runtime"], "ENV"))
    port = re.findall(r"PDSERVE_HEALTH_PORT=(\d+)", " ".join(values(all_stages[name], "ENV"))) or \
        re.findall(r"PDSERVE_HEALTH_PORT=(\d+)", env)
    assert int(port[0]) == default_port
    assert str(default_port) in values(all_stages[name], "EXPOSE")[0].split()


def test_no_build_tools_in_what_ships():
    all_stages = stages()
    for name in ["runtime", *FINAL]:
        for ins in all_stages[name]:
            assert not COMPILERS.search(ins["value"]) or ins["instruction"] == "CMD", (name, ins["content"])
            assert ins["instruction"] != "RUN" or "apt-get install" not in ins["value"], (name, ins["content"])
    assert any("build-essential" in v for v in values(all_stages["build"], "RUN"))


def test_each_tier_gets_only_its_framework():
    all_stages = stages()
    pins = {name: " ".join(values(all_stages[f"venv-{name}"], "RUN") + values(all_stages[f"venv-{name}"], "ARG"))
            for name in FINAL}
    assert "jax" not in pins["coordinator"] and "torch" not in pins["coordinator"]
    assert "jax[${JAX_EXTRA}]==${JAX_VERSION}" in pins["prefill"] and "JAX_EXTRA=tpu" in pins["prefill"]
    assert "torch" not in pins["prefill"]
    assert "torch==${TORCH_VERSION}" in pins["decode"] and "jax" not in pins["decode"]
    # vLLM brings its own torch: no pdserve torch pin, no constraints file that would fight vLLM's pins.
    assert "[vllm]" in pins["decode-vllm"] and "vllm==${VLLM_VERSION}" in pins["decode-vllm"]
    assert "torch" not in pins["decode-vllm"] and "constraints" not in pins["decode-vllm"]
    assert "jax" not in pins["decode-vllm"]
    # The pins follow the project's: torch exactly, jax the version the tests run with.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "torch==2.13.0" in project["optional-dependencies"]["decode"]
    assert "TORCH_VERSION=2.13.0" in pins["decode"]
    import jax

    assert f"JAX_VERSION={jax.__version__}" in pins["prefill"]


def test_copied_sources_exist_and_dockerignore_keeps_the_context_small():
    all_stages = stages()
    for stage in all_stages.values():
        for copy in values(stage, "COPY"):
            if copy.startswith("--from="):
                continue
            *sources, _dest = copy.split()
            for source in sources:
                assert (ROOT / source).exists(), source
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", "tests", "**/__pycache__"} <= set(ignored)


def test_the_coordinator_image_needs_neither_jax_nor_torch():
    """The coordinator image installs the base dependencies only: its modules must not import a framework."""
    import subprocess
    import sys

    code = (
        "import importlib, pkgutil, sys\n"
        "import server.cli, server.coordinator as c\n"
        "for m in pkgutil.iter_modules(c.__path__): importlib.import_module('pdserve.server.coordinator.' + m.name)\n"
        "print(sorted(n for n in ('jax', 'torch', 'transformers') if n in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_decode_image_ships_its_c_kernels_prebuilt():
    """The runtime stage has no compiler: the build stage prebuilds the fused CPU MoE kernel for every x86-64
    level, and the decode image points the worker at them (server/native_build.py; tests/test_native_build.py
    loads such a library with no compiler on PATH)."""
    all_stages = stages()
    run = " ".join(values(all_stages["venv-decode"], "RUN"))
    assert "-m pdserve.server.native_build --prebuild /opt/pdserve/kernels --kernel cpu_moe" in run
    env = " ".join(values(all_stages["decode"], "ENV"))
    assert "PDSERVE_PREBUILT_KERNELS=/opt/pdserve/kernels" in env
