"""The Grafana dashboard in deploy/grafana reads only series pdserve exports, for a role that exports them."""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests.deploy.test_wiring import agreed_metric_names

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "pdserve.json"
METRIC = re.compile(r"\b(?:pdserve_|vllm:)[a-zA-Z0-9_:]+")


def _queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert panels and all(p["targets"] for p in panels)
    queries = [t["expr"] for p in panels for t in p["targets"]]
    queries += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return queries


def test_every_query_reads_a_metric_pdserve_exports():
    exported = agreed_metric_names()
    queries = _queries()
    used = {name for q in queries for name in METRIC.findall(q)}
    assert len(used) >= 15
    assert sorted(used - exported) == []


def test_every_query_filters_by_model_and_names_a_role():
    for query in _queries():
        if query.startswith("label_values"):
            continue
        for selector in re.findall(r"(?:pdserve_|vllm:)[\w:]+(\{[^}]*\})?", query):
            assert 'model_name=~"$model_name"' in selector, query
        assert "role=" in query or "by (role)" in query, query


def test_the_tiers_sit_side_by_side():
    titles = [p["title"] for p in json.loads(DASHBOARD.read_text())["panels"]]
    assert {"Time to first token", "Inter-token latency", "Decode KV cache usage",
            "KV transfer GB/s (received by decode)", "Migrations and prefill retries"} <= set(titles)


def test_the_speculative_acceptance_rate_is_accepted_over_proposed_tokens():
    panels = {p["title"]: p for p in json.loads(DASHBOARD.read_text())["panels"]}
    expr = panels["Speculative decoding acceptance rate"]["targets"][0]["expr"]
    accepted, proposed = expr.split(" / ")
    assert "vllm:spec_decode_num_accepted_tokens_total" in accepted and "vllm:spec_decode_num_draft_tokens_total" in proposed
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total" in \
        panels["Speculative decoding acceptance by position"]["targets"][0]["expr"]
