"""`pdserve up --metrics-port` merges every process's /metrics (server/cluster_metrics.py): each process's
samples labelled engine and worker, one HELP/TYPE per family, histograms and counters intact, a dead or
silent process skipped and reported by pdserve_worker_up. The real cluster: tests/security/test_supervisor.py."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from pdserve.server.cluster_metrics import Target, cluster_text, merge, serve_cluster_metrics, targets_of
from pdserve.server.coordinator.config import CoordinatorConfig
from pdserve.server.launcher import Cluster, Proc, free_port

OWN = """\
# HELP pdserve_worker_restarts_total Processes restarted
# TYPE pdserve_worker_restarts_total counter
pdserve_worker_restarts_total{model_name="m",role="decode"} 1.0
# HELP vllm:kv_cache_usage_perc KV cache usage
# TYPE vllm:kv_cache_usage_perc gauge
"""
DECODE = """\
# HELP vllm:kv_cache_usage_perc KV cache usage
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m",role="decode"} 0.25
# HELP vllm:prompt_tokens_total Prompt tokens
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{model_name="m",role="decode"} 7.0
# HELP pdserve_kv_transfer_seconds One request's KV transfer
# TYPE pdserve_kv_transfer_seconds histogram
pdserve_kv_transfer_seconds_bucket{le="0.1",model_name="m",role="decode"} 1.0
pdserve_kv_transfer_seconds_bucket{le="+Inf",model_name="m",role="decode"} 2.0
pdserve_kv_transfer_seconds_count{model_name="m",role="decode"} 2.0
pdserve_kv_transfer_seconds_sum{model_name="m",role="decode"} 0.65
"""
PREFILL = """\
# HELP vllm:prompt_tokens_total Prompt tokens
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{model_name="m",role="prefill"} 5.0
# HELP vllm:kv_cache_usage_perc KV cache usage
# TYPE vllm:kv_cache_usage_perc summary
vllm:kv_cache_usage_perc_sum{model_name="m",role="prefill"} 9.0
vllm:kv_cache_usage_perc_count{model_name="m",role="prefill"} 3.0
"""
PREFILL_0, DECODE_0 = Target("prefill-0", 0, "prefill", "127.0.0.1:1"), Target("decode-0", 1, "decode", "127.0.0.1:2")


def _lines(text: str, prefix: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(prefix)]


def test_each_process_samples_carry_its_engine_and_worker_and_the_own_ones_stay_as_they_are():
    text = merge(OWN, [(PREFILL_0, PREFILL), (DECODE_0, DECODE)], "m")
    families = list(text_string_to_metric_families(text))  # the Prometheus text format, as a scraper reads it
    assert [f.name for f in families].count("vllm:prompt_tokens") == 1
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in families for s in f.samples}
    assert samples[("pdserve_worker_restarts_total", (("model_name", "m"), ("role", "decode")))] == 1.0
    assert samples[("vllm:prompt_tokens_total", (("engine", "0"), ("model_name", "m"), ("role", "prefill"),
                                                 ("worker", "prefill-0")))] == 5.0
    assert samples[("vllm:prompt_tokens_total", (("engine", "1"), ("model_name", "m"), ("role", "decode"),
                                                 ("worker", "decode-0")))] == 7.0
    # an engine label the process set itself (vLLM's own engine index) gives way to the cluster's
    assert samples[("vllm:kv_cache_usage_perc", (("engine", "1"), ("model_name", "m"), ("role", "decode"),
                                                 ("worker", "decode-0")))] == 0.25
    assert [k for k in samples if k[0] == "vllm:kv_cache_usage_perc"] == [
        ("vllm:kv_cache_usage_perc", (("engine", "1"), ("model_name", "m"), ("role", "decode"), ("worker", "decode-0")))]


def test_help_and_type_once_per_family_and_histograms_intact():
    text = merge(OWN, [(PREFILL_0, PREFILL), (DECODE_0, DECODE)], "m")
    for family in ("vllm:prompt_tokens_total", "vllm:kv_cache_usage_perc", "pdserve_kv_transfer_seconds"):
        assert len(_lines(text, f"# HELP {family} ")) == 1 and len(_lines(text, f"# TYPE {family} ")) == 1, text
    assert _lines(text, "# TYPE vllm:prompt_tokens_total ") == ["# TYPE vllm:prompt_tokens_total counter"]
    assert len(_lines(text, "vllm:prompt_tokens_total{")) == 2
    # the prefill text's kv_cache_usage_perc claims another type: left out, not mixed into the gauge
    assert "vllm:kv_cache_usage_perc_sum" not in text and "vllm:kv_cache_usage_perc_count" not in text
    assert _lines(text, "pdserve_kv_transfer_seconds_") == [
        'pdserve_kv_transfer_seconds_bucket{engine="1",worker="decode-0",le="0.1",model_name="m",role="decode"} 1.0',
        'pdserve_kv_transfer_seconds_bucket{engine="1",worker="decode-0",le="+Inf",model_name="m",role="decode"} 2.0',
        'pdserve_kv_transfer_seconds_count{engine="1",worker="decode-0",model_name="m",role="decode"} 2.0',
        'pdserve_kv_transfer_seconds_sum{engine="1",worker="decode-0",model_name="m",role="decode"} 0.65',
    ]


def test_a_process_not_reached_is_skipped_and_reported_down():
    text = merge(OWN, [(PREFILL_0, None), (DECODE_0, DECODE)], "m")
    assert 'worker="prefill-0"' not in "".join(_lines(text, "vllm:"))
    assert _lines(text, "pdserve_worker_up{") == [
        'pdserve_worker_up{model_name="m",role="prefill",engine="0",worker="prefill-0"} 0.0',
        'pdserve_worker_up{model_name="m",role="decode",engine="1",worker="decode-0"} 1.0',
    ]


def test_labels_go_onto_every_kind_of_sample_line():
    lines = ('bare 1.0\nempty{} 2.0\nlast{a="x"} 3.0 1700000000\n'
             'own{engine="0"} 4.0\nmid{a="1",worker="w",b="2"} 5.0\nnovalue\nnovalue{a="1"}\n')
    text = merge("", [(DECODE_0, lines)])
    assert _lines(text, "bare") + _lines(text, "empty") + _lines(text, "last") + _lines(text, "own") + \
        _lines(text, "mid") == ['bare{engine="1",worker="decode-0"} 1.0', 'empty{engine="1",worker="decode-0"} 2.0',
                                'last{engine="1",worker="decode-0",a="x"} 3.0 1700000000',
                                'own{engine="1",worker="decode-0"} 4.0',
                                'mid{engine="1",worker="decode-0",a="1",b="2"} 5.0']
    assert "novalue" not in text  # a line Prometheus would refuse the whole scrape for is dropped
    assert len(list(text_string_to_metric_families(text))) == 6  # the five, and pdserve_worker_up


def _worker(role: str, tokens: float) -> tuple[int, object]:
    registry = CollectorRegistry()
    Counter("vllm:prompt_tokens", "Prompt tokens", ["model_name", "role"], registry=registry).labels("m", role).inc(tokens)
    Gauge("vllm:kv_cache_usage_perc", "KV cache usage", ["model_name", "role"], registry=registry).labels("m", role).set(0.5)
    server, _ = start_http_server(0, addr="127.0.0.1", registry=registry)
    return server.server_address[1], server


def test_the_collector_scrapes_live_processes_concurrently_and_skips_a_dead_and_a_silent_one():
    (p_port, p_server), (d_port, d_server) = _worker("prefill", 3), _worker("decode", 4)
    silent = free_port()  # nothing listens there: refused
    targets = [Target("prefill-0", 0, "prefill", f"127.0.0.1:{p_port}"),
               Target("decode-0", 1, "decode", f"127.0.0.1:{d_port}"),
               Target("decode-1", 2, "decode", f"127.0.0.1:{silent}"),
               Target("coordinator", 3, "coordinator", "127.0.0.1:9", alive=False)]
    own = CollectorRegistry()
    Counter("pdserve_worker_restarts", "Restarts", ["model_name", "role"], registry=own).labels("m", "decode").inc()
    try:
        text = cluster_text(targets, "m", own=own, timeout=2.0)
        port = serve_cluster_metrics(free_port(), "127.0.0.1", lambda: targets, "m", own=own)
        served = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        p_server.shutdown()
        d_server.shutdown()
    assert _lines(text, "vllm:prompt_tokens_total{") == [
        'vllm:prompt_tokens_total{engine="0",worker="prefill-0",model_name="m",role="prefill"} 3.0',
        'vllm:prompt_tokens_total{engine="1",worker="decode-0",model_name="m",role="decode"} 4.0',
    ]
    assert _lines(text, "pdserve_worker_restarts_total{") == ['pdserve_worker_restarts_total{model_name="m",role="decode"} 1.0']
    # served over HTTP: the same series, beside the served process's own registry
    assert _lines(served, "vllm:prompt_tokens_total{") == _lines(text, "vllm:prompt_tokens_total{")
    assert [line.rsplit(" ", 1)[1] for line in _lines(text, "pdserve_worker_up{")] == ["1.0", "1.0", "0.0", "0.0"]


def test_the_cluster_lists_each_process_metrics_address_in_its_state_and_as_targets():
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        cluster = Cluster(prefill=[Proc("prefill-0", "127.0.0.1:5", running, metrics_address="127.0.0.1:6")],
                          decode=[Proc("decode-0", "127.0.0.1:7", done, metrics_address="127.0.0.1:8")],
                          coordinator=Proc("coordinator", "127.0.0.1:9", running))
        assert cluster.describe()["metrics"] == {"prefill-0": "127.0.0.1:6", "decode-0": "127.0.0.1:8"}
        assert cluster.metrics_targets() == [Target("prefill-0", 0, "prefill", "127.0.0.1:6", alive=True),
                                             Target("decode-0", 1, "decode", "127.0.0.1:8", alive=False)]
    finally:
        running.kill()
        running.wait()


def test_worker_metrics_flags_number_the_workers_in_order_and_a_bad_entry_is_refused(tiny_model):
    entries = ["prefill-0=127.0.0.1:9101", "decode-0=127.0.0.1:9102"]
    config = CoordinatorConfig(model_dir=tiny_model("llama"), worker_metrics=entries)
    assert targets_of(config.worker_metrics) == [Target("prefill-0", 0, "prefill", "127.0.0.1:9101"),
                                                 Target("decode-0", 1, "decode", "127.0.0.1:9102")]
    for bad in ("127.0.0.1:9101", "decode-0=localhost", "=127.0.0.1:9101"):
        with pytest.raises(ValueError, match="--worker-metrics"):
            CoordinatorConfig(model_dir=tiny_model("llama"), worker_metrics=[bad])
