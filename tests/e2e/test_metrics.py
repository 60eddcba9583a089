"""Prometheus metrics (agreed names, real values), admission (queue overflow, deadline) and JSON logs,
on a coordinator and one decode worker that prefills locally (no prefill worker: quick to start)."""

from __future__ import annotations

import json

import grpc
import pytest

from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import worker_pb2, worker_pb2_grpc
from tests.e2e.procs import Procs, Stream, blocks, counter, generate, list_workers, request, wait_blocks_free, wait_until

AGREED = [
    "pdserve_num_requests_running", "pdserve_num_requests_waiting", "pdserve_kv_cache_usage_perc",
    "pdserve_kv_blocks_used", "pdserve_kv_blocks_total", "pdserve_prefill_queued_tokens",
    "pdserve_request_success_total", "pdserve_request_failure_total", "pdserve_time_to_first_token_seconds",
    "pdserve_inter_token_latency_seconds", "pdserve_e2e_request_latency_seconds",
    "pdserve_request_queue_time_seconds", "pdserve_prompt_tokens_total", "pdserve_generation_tokens_total",
    "pdserve_kv_transfer_bytes_total", "pdserve_kv_transfer_seconds", "pdserve_prefill_retries_total",
    "pdserve_migrations_total", "pdserve_local_prefill_fallbacks_total", "pdserve_admission_rejections_total",
    "pdserve_num_preemptions_total", "pdserve_prefix_cache_queries_total", "pdserve_prefix_cache_hits_total",
]


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    procs = Procs(tiny_model("llama"), tmp_path_factory.mktemp("metrics"))
    try:
        coordinator = procs.coordinator("coordinator", "--max-queue", "1", "--log-format", "json")
        # --max-queue 0: d0 queues nothing itself, so requests that do not fit wait in the coordinator's queue
        procs.worker("d0", "decode", coordinator, "--max-running", "2", "--max-queue", "0", "--kv-cache-tokens", "4096")
        yield procs
    finally:
        procs.stop_all()


def test_every_agreed_metric_is_exported_with_real_values(cluster):
    coordinator, d0 = cluster.procs["coordinator"], cluster.procs["d0"]
    prompts = [[3, 4, 5, 6], [7, 8, 9]]
    outputs = [generate(coordinator.address, request(prompt, 9)) for prompt in prompts]
    assert [len(o) for o in outputs] == [9, 9]
    c, d = coordinator.metrics(), d0.metrics()
    families = coordinator.families() | d0.families()
    assert [n for n in AGREED if n not in families and n.removesuffix("_total") not in families] == []
    assert c['pdserve_request_success_total{finished_reason="length"}'] == 2
    assert c["pdserve_prompt_tokens_total"] == 7 and c["pdserve_generation_tokens_total"] == 18
    assert c["pdserve_time_to_first_token_seconds_count"] == 2
    assert c["pdserve_inter_token_latency_seconds_count"] == 16
    assert c["pdserve_e2e_request_latency_seconds_count"] == 2
    # the phases: prefill (scheduled to first token) within the TTFT, decode the sum of the token gaps
    phases = ("request_prefill_time", "request_decode_time", "request_inference_time", "request_time_per_output_token")
    assert [c[f"pdserve_{p}_seconds_count"] for p in phases] == [2, 2, 2, 2]
    assert 0 < c["pdserve_request_prefill_time_seconds_sum"] <= c["pdserve_time_to_first_token_seconds_sum"]
    assert c["pdserve_request_decode_time_seconds_sum"] == pytest.approx(c["pdserve_inter_token_latency_seconds_sum"])
    assert c["pdserve_request_inference_time_seconds_sum"] == pytest.approx(
        c["pdserve_request_prefill_time_seconds_sum"] + c["pdserve_request_decode_time_seconds_sum"])
    assert c["pdserve_request_time_per_output_token_seconds_sum"] == pytest.approx(
        c["pdserve_request_decode_time_seconds_sum"] / 8)
    old_tpot = [line for line in coordinator.metrics_text().splitlines()  # the older name of the token gaps
                if line.startswith("vllm:time_per_output_token_seconds_count")]
    assert [float(line.rsplit(" ", 1)[1]) for line in old_tpot] == [16.0]
    assert c["pdserve_local_prefill_fallbacks_total"] == 2 and d["pdserve_local_prefill_fallbacks_total"] == 2
    free, total = blocks(d0)
    assert d["pdserve_kv_blocks_total"] == total == 256
    assert d["pdserve_kv_blocks_used"] == total - free == 0 and d["pdserve_kv_cache_usage_perc"] == 0.0
    assert d["pdserve_num_requests_running"] == 0


def test_queue_overflow_is_resource_exhausted_with_a_hint_and_a_deadline_is_deadline_exceeded(cluster):
    coordinator, d0 = cluster.procs["coordinator"], cluster.procs["d0"]
    # Two requests that wait for KV that never comes fill d0's running cap (2) until cancelled.
    channel = grpc.insecure_channel(d0.address)
    holds = [worker_pb2_grpc.DecodeStub(channel).Decode(worker_pb2.DecodeRequest(
        request_id=f"hold-{i}", prompt_token_ids=[3, 4, 5], sampling=gen_pb.SamplingParams(max_tokens=20),
        transfer_token=b"t" * 16, lease_seconds=60)) for i in range(2)]
    assert [next(h).WhichOneof("event") for h in holds] == ["reserved", "reserved"]
    wait_until(lambda: list_workers(coordinator)[0].info.load.waiting_requests == 2, "the coordinator sees the cap")
    assert blocks(d0) == (256 - 2, 256)  # one block each for the prompt; max_tokens reserves nothing
    queued = Stream(coordinator.address, request([11, 12], 5), timeout=1.5)  # waits for room, then expires
    wait_until(lambda: coordinator.metrics()["pdserve_num_requests_waiting"] == 1, "one request queued", every=0.02)
    with pytest.raises(grpc.RpcError) as e:
        generate(coordinator.address, request([13, 14], 5))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "decode queue is full (1 waiting); you may retry" in e.value.details()
    assert ("retry-after-ms", "500") in tuple(e.value.trailing_metadata())
    queued.join(30)
    assert queued.error is not None and queued.error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert queued.tokens == []
    for h in holds:  # a cancelled Decode frees its blocks at once
        h.cancel()
    channel.close()
    free, total = wait_blocks_free([d0])[0]
    assert free == total
    c = coordinator.metrics()
    assert c['pdserve_admission_rejections_total{tier="decode"}'] == 1
    assert c['pdserve_request_failure_total{code="RESOURCE_EXHAUSTED"}'] == 1
    assert c["pdserve_request_queue_time_seconds_count"] >= 2
    assert [w.inflight for w in list_workers(coordinator)] == [0]
    assert len(generate(coordinator.address, request([13, 14], 5))) == 5  # room again


def test_json_logs_carry_the_request_id_on_every_request_line(cluster):
    coordinator = cluster.procs["coordinator"]
    req = request([21, 22, 23], 4)
    req.request_id = "log-me-7"
    with pytest.raises(grpc.RpcError):  # an invalid request still logs nothing but its own id
        generate(coordinator.address, gen_pb.GenerateRequest(text=""))
    assert len(generate(coordinator.address, req)) == 4
    lines = [json.loads(line) for line in coordinator.log.read_text().splitlines() if line.strip()]
    assert all({"time", "level", "process", "logger", "request_id", "message"} <= set(line) for line in lines)
    mine = [line for line in lines if line["request_id"] == "log-me-7"]
    assert mine and all(line["process"] == "coordinator" for line in mine)
    assert any("prefills it" in line["message"] for line in mine)  # the local-prefill line names it
    assert counter(coordinator.metrics(), "pdserve_request_failure_total") >= 2


VLLM_TYPES = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:request_success_total": "counter", "vllm:prompt_tokens_total": "counter",
    "vllm:generation_tokens_total": "counter",
    "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram", "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram", "vllm:request_generation_tokens": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:request_prefill_time_seconds": "histogram", "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram", "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram", "vllm:gpu_cache_usage_perc": "gauge",
}
"""vLLM's names and types (vllm/v1/metrics/loggers.py), as a Grafana dashboard for vLLM reads them."""
VLLM_BUCKETS = {
    "vllm:time_to_first_token_seconds": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                                         5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0],
    "vllm:inter_token_latency_seconds": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                                         7.5, 10.0, 20.0, 40.0, 80.0],
    "vllm:e2e_request_latency_seconds": [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                                         60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0],
    "vllm:request_prompt_tokens": [1, 2, 5, 10, 20, 50, 100, 200, 500],
    "vllm:request_prefill_time_seconds": [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                                          60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0],
    "vllm:request_time_per_output_token_seconds": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                                                   1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0],  # 1-2-5 up to max_model_len (512 here)
}


def _series(text: str) -> list[tuple[str, dict[str, str]]]:
    import re

    out = []
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, rest = line.partition("{")
            labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', rest.rpartition("}")[0])) if rest else {}
            out.append((name.split()[0], labels))
    return out


def test_every_series_names_its_model_and_role_and_vllm_names_have_vllm_types_and_buckets(cluster):
    coordinator, d0 = cluster.procs["coordinator"], cluster.procs["d0"]
    assert len(generate(coordinator.address, request([3, 4, 5], 4))) == 4
    model = cluster.model_dir.name
    types: dict[str, str] = {}
    for proc in (coordinator, d0):
        text = proc.metrics_text()
        ours = [(n, labels) for n, labels in _series(text) if n.startswith(("pdserve_", "vllm:"))]
        assert ours
        assert [n for n, labels in ours if labels.get("model_name") != model or labels.get("role") != proc.role] == []
        for line in text.splitlines():
            if line.startswith("# TYPE vllm:"):
                _, _, name, kind = line.split()
                types[name] = kind
        if proc is coordinator:
            for name, bounds in VLLM_BUCKETS.items():
                got = [float(labels["le"]) for n, labels in ours if n == f"{name}_bucket"]
                assert got == [*map(float, bounds), float("inf")], name
    assert {n: types.get(n) for n in VLLM_TYPES} == VLLM_TYPES
    c = {f"{n}{sorted(labels.items())}": labels for n, labels in _series(coordinator.metrics_text())}
    assert any(k.startswith("vllm:request_success_total") and v.get("finished_reason") == "length" for k, v in c.items())


def test_a_decode_worker_prefilling_locally_returns_logprobs_equal_to_transformers(cluster):
    """No prefill worker here: the prompt's logprobs come from the decode worker's torch prefill."""
    import numpy as np
    import torch
    import transformers

    from pdserve.server.client import stream

    prompt = [1, 17, 45, 99, 3, 250, 7]
    req = request(prompt, 4, logprobs=2, prompt_logprobs=1)
    messages = list(stream(cluster.procs["coordinator"].address, req, timeout=60))
    out = [t for m in messages for t in m.token_ids]
    hf = transformers.AutoModelForCausalLM.from_pretrained(cluster.model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + out])).logits[0].log_softmax(-1).numpy()  # [S, V]
    prompt_lps = [e for m in messages for e in m.prompt_logprobs]
    assert [e.token_id for e in prompt_lps] == prompt[1:]
    np.testing.assert_allclose([e.logprob for e in prompt_lps], [ref[i - 1, prompt[i]] for i in range(1, 7)],
                               atol=1e-4)
    token_lps = [e for m in messages for e in m.logprobs]
    assert [e.token_id for e in token_lps] == out
    np.testing.assert_allclose([e.logprob for e in token_lps], [ref[6 + j, t] for j, t in enumerate(out)], atol=1e-4)
    assert all(list(e.top_token_ids) == np.argsort(-ref[6 + j], kind="stable")[:2].tolist()
               for j, e in enumerate(token_lps))
