"""deploy/ renders offline, every object validates against the Kubernetes (and CRD) schemas, YAML lints."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from kubernetes_validate import utils as kv

from tests.deploy.manifests import DEPLOY, KUSTOMIZATIONS, by_kind, render

# The oldest Kubernetes minor GKE still runs in its channels, and the newest the schemas know.
K8S_VERSIONS = ["1.31", kv.latest_version()]
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "PodMonitor"): Path(__file__).parent / "schemas" / "podmonitor.monitoring.coreos.com_v1.json",
}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: render(path) for name, path in KUSTOMIZATIONS.items()}


def validate(obj: dict, version: str) -> None:
    """Raises when obj does not validate: built-in kinds strictly (no unknown fields), CRDs by our schema."""
    schema = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
    if schema is not None:
        jsonschema.Draft202012Validator(json.loads(schema.read_text())).validate(obj)
    else:
        kv.validate(obj, version, strict=True)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("kustomization", list(KUSTOMIZATIONS))
def test_every_object_validates(rendered, kustomization, version):
    objects = rendered[kustomization]
    errors = []
    for obj in objects:
        try:
            validate(obj, version)
        except (jsonschema.ValidationError, kv.SchemaNotFoundError) as e:
            path = ".".join(str(p) for p in getattr(e, "path", []))
            errors.append(f"{obj['kind']}/{obj['metadata']['name']}: {path}: {getattr(e, 'message', e)}")
    assert errors == []


def test_renders_hold_the_expected_objects(rendered):
    kinds = lambda name: sorted(f"{o['kind']}/{o['metadata']['name']}" for o in rendered[name])  # noqa: E731
    tiers = ["pdserve-coordinator", "pdserve-decode", "pdserve-prefill"]
    common = sorted(
        [f"Deployment/{t}" for t in tiers]
        + [f"PodDisruptionBudget/{t}" for t in tiers]
        + [f"NetworkPolicy/{t}" for t in tiers]
        + ["HorizontalPodAutoscaler/pdserve-decode", "HorizontalPodAutoscaler/pdserve-prefill"]
        + ["Service/pdserve-coordinator", "Service/pdserve-coordinator-registry", "Service/pdserve-decode-kv",
           "Service/pdserve-prefill"]
    )
    config_maps = sorted(f"ConfigMap/{o['metadata']['name']}" for o in by_kind(rendered["base"], "ConfigMap"))
    assert [c.rsplit("-", 1)[0] for c in config_maps] == [f"ConfigMap/{t}" for t in tiers]
    assert kinds("base") == sorted(common + config_maps + ["PodMonitor/pdserve"])
    assert [k for k in kinds("gke") if not k.startswith("ConfigMap/")] == sorted(
        [k for k in kinds("base") if not k.startswith("ConfigMap/")] + ["HorizontalPodAutoscaler/pdserve-coordinator"]
    )
    # cpu: no PodMonitor (kind/minikube have no prometheus-operator unless installed).
    assert [k for k in kinds("cpu") if not k.startswith("ConfigMap/")] == [
        k for k in kinds("base") if not k.startswith("ConfigMap/") and k != "PodMonitor/pdserve"
    ]


@pytest.mark.parametrize(
    "mutate, kind",
    [
        (lambda d: d["spec"]["template"]["spec"]["containers"][0].update(portz=[]), "Deployment"),
        (lambda d: d["spec"]["template"]["spec"]["containers"][0]["ports"][0].update(containerPort="50051"), "Deployment"),
        (lambda d: d["spec"]["template"]["spec"]["containers"][0]["readinessProbe"].update(grpc={}), "Deployment"),
        (lambda d: d["spec"]["podMetricsEndpoints"][0].update(interval="15 seconds"), "PodMonitor"),
        (lambda d: d["spec"]["podMetricsEndpoints"][0].update(prot="metrics"), "PodMonitor"),
        (lambda d: d["spec"]["metrics"][0]["pods"].pop("metric"), "HorizontalPodAutoscaler"),
    ],
    ids=["unknown-field", "port-as-string", "grpc-probe-without-port", "bad-duration", "podmonitor-typo", "hpa-without-metric"],
)
def test_validation_catches_broken_objects(rendered, mutate, kind):
    obj = copy.deepcopy(by_kind(rendered["base"], kind)[0])
    validate(obj, K8S_VERSIONS[-1])
    mutate(obj)
    with pytest.raises(jsonschema.ValidationError):
        validate(obj, K8S_VERSIONS[-1])


def test_yaml_lints_clean():
    files = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml"))
    assert len(files) >= 15
    out = subprocess.run([sys.executable, "-m", "yamllint", "--strict", "-c", str(DEPLOY / ".yamllint"), *map(str, files)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
