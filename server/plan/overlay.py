"""A plan as a kustomize overlay over deploy/base: replica counts and the HPA bounds and targets it implies.

- Replicas: the plan's prefill and decode workers (colocated: the prefill Deployment, its HPA and its
  PodDisruptionBudget deleted; the decode workers prefill locally, as `pdserve up --prefill-workers 0`).
- HPA minReplicas: the plan's counts (the pools the simulation met the SLOs with); maxReplicas: twice.
- Prefill target (`pdserve_prefill_queued_seconds`, seconds of queued work per pod): half the TTFT SLO,
  so a pod scales out while a queued prompt can still make its first token in time.
- Decode target (`pdserve_kv_cache_usage_perc`): the simulated mean KV usage x 1.25, within [0.5, 0.9]:
  above what the plan's pool runs at, below a cache so full that admission starts to queue.
Node pools (which accelerator each tier lands on) are the cluster's: see deploy/overlays/gke.
"""

from __future__ import annotations

import os
from pathlib import Path

from pdserve.server.plan.size import Plan, Slo

BASE = Path(__file__).resolve().parents[2] / "deploy" / "base"


def kv_target(plan: Plan) -> float:
    return round(min(0.9, max(0.5, 1.25 * plan.kv_usage)), 2)


def _hpa_patch(name: str, low: int, high: int, metric: str, value: str) -> str:
    return f"""  - target:
      kind: HorizontalPodAutoscaler
      name: {name}
    patch: |-
      - op: replace
        path: /spec/minReplicas
        value: {low}
      - op: replace
        path: /spec/maxReplicas
        value: {high}
      - op: replace
        path: /spec/metrics/0/pods/target/averageValue
        value: "{value}"
"""


def _delete(kind: str, api: str, name: str) -> str:
    return f"""  - patch: |-
      $patch: delete
      apiVersion: {api}
      kind: {kind}
      metadata:
        name: {name}
"""


def render(plan: Plan, slo: Slo, base: Path, at: Path) -> str:
    rel = os.path.relpath(base, at)
    colocated = not plan.prefill_workers
    prefill = "none (colocated)" if colocated else f"{plan.prefill_workers} x {plan.chips_per_prefill} {plan.prefill_hw} " \
        f"({plan.prefill_weights} weights)"
    head = f"""# Written by `pdserve plan size`: {plan.pairing}, prefill {prefill}, decode {plan.decode_workers} x \
{plan.chips_per_decode} {plan.decode_hw} ({plan.decode_weights} weights, {plan.kv_dtype} KV);
# ${plan.dollars_per_hour:.2f}/h, ${plan.dollars_per_mtok:.3f}/Mtok, goodput {plan.goodput_per_chip:.3f} req/s per chip \
at TTFT <= {slo.ttft_ms:g} ms, TPOT <= {slo.tpot_ms:g} ms ({plan.attainment:.0%} attained in simulation).
# Put each tier on its accelerator's node pool as deploy/overlays/gke does.
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization

resources:
  - {rel}

replicas:
"""
    replicas = ([] if colocated else [f"  - name: pdserve-prefill\n    count: {plan.prefill_workers}\n"])
    replicas.append(f"  - name: pdserve-decode\n    count: {plan.decode_workers}\n")
    patches = ["\npatches:\n"]
    if colocated:
        patches += [_delete("Deployment", "apps/v1", "pdserve-prefill"),
                    _delete("HorizontalPodAutoscaler", "autoscaling/v2", "pdserve-prefill"),
                    _delete("PodDisruptionBudget", "policy/v1", "pdserve-prefill")]
    else:
        queued = f"{slo.ttft_ms / 2000:g}"
        patches.append(_hpa_patch("pdserve-prefill", plan.prefill_workers, 2 * plan.prefill_workers,
                                  "pdserve_prefill_queued_seconds", queued))
    patches.append(_hpa_patch("pdserve-decode", plan.decode_workers, 2 * plan.decode_workers,
                              "pdserve_kv_cache_usage_perc", f"{int(kv_target(plan) * 1000)}m"))
    return head + "".join(replicas) + "".join(patches)


def write_overlay(directory: Path, plan: Plan, slo: Slo, base: Path = BASE) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "kustomization.yaml"
    path.write_text(render(plan, slo, base, directory.resolve()))
    return path
