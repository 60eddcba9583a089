"""Every Prometheus metric pdserve exports, with vLLM's meanings under a `pdserve_` prefix.

Each process serves the ones it updates on `--metrics-port` (0: off). Gauges of live state (running
requests, KV blocks) are read when scraped, through `set_function`, so they are never stale.
"""

from __future__ import annotations

import logging

from prometheus_client import Counter, Gauge, Histogram, disable_created_metrics, start_http_server

log = logging.getLogger("pdserve")
disable_created_metrics()  # no *_created series: dashboards built for vLLM do not read them

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                         1.0, 2.5, 5.0)

# ---- state (gauges) ------------------------------------------------------------
num_requests_running = Gauge("pdserve_num_requests_running", "Requests running (decoding, or prefilling on a prefill worker)")
num_requests_waiting = Gauge("pdserve_num_requests_waiting", "Requests waiting (in a queue, or for their KV)")
kv_cache_usage_perc = Gauge("pdserve_kv_cache_usage_perc", "KV cache usage: 0 is empty, 1 is full")
kv_blocks_used = Gauge("pdserve_kv_blocks_used", "KV cache blocks in use")
kv_blocks_total = Gauge("pdserve_kv_blocks_total", "KV cache blocks in all")
prefill_queued_tokens = Gauge("pdserve_prefill_queued_tokens", "Prompt tokens waiting to be prefilled")
prefill_queued_seconds = Gauge("pdserve_prefill_queued_seconds",
                               "Seconds of prefill work queued, at the measured rate per length bucket")

# ---- outcomes (counters) ---------------------------------------------------------
request_success = Counter("pdserve_request_success", "Requests that finished, by finish reason", ["finished_reason"])
request_failure = Counter("pdserve_request_failure", "Requests that ended with an error status, by code", ["code"])
prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens processed")
generation_tokens = Counter("pdserve_generation_tokens", "Tokens generated")
kv_transfer_bytes = Counter("pdserve_kv_transfer_bytes", "KV bytes transferred (sent by prefill, received by decode)")
prefill_retries = Counter("pdserve_prefill_retries", "Prefills retried on another worker")
migrations = Counter("pdserve_migrations", "Requests moved to another decode worker mid-stream")
vllm_kv_tokens_loaded = Counter("pdserve_vllm_kv_tokens_loaded", "Prompt tokens whose KV the connector wrote into vLLM's cache")
vllm_kv_load_failures = Counter("pdserve_vllm_kv_load_failures", "Requests whose pushed KV vLLM could not load (it recomputed them)")
local_prefill_fallbacks = Counter("pdserve_local_prefill_fallbacks", "Prompts prefilled on a decode worker (no prefill worker alive)")
num_preemptions = Counter("pdserve_num_preemptions", "Decode sequences preempted (blocks freed, re-prefilled later)")
prefix_cache_queries = Counter("pdserve_prefix_cache_queries", "Tokens looked up in the decode prefix cache")
prefix_cache_hits = Counter("pdserve_prefix_cache_hits", "Tokens found in the decode prefix cache (KV not sent again)")
admission_rejections = Counter("pdserve_admission_rejections", "Requests refused because a tier's queue was full", ["tier"])
expected_wait_rejections = Counter("pdserve_expected_wait_rejections",
                                   "Requests refused because their expected prefill wait exceeded the deadline or TTFT budget")
worker_restarts = Counter("pdserve_worker_restarts", "Processes `pdserve up` started again after they died", ["role"])
stalled_streams = Counter("pdserve_stalled_streams", "Decode streams that sent nothing for --stall-timeout and migrated")

# ---- latency (histograms) -----------------------------------------------------------
time_to_first_token = Histogram("pdserve_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS)
inter_token_latency = Histogram("pdserve_inter_token_latency_seconds", "Time between output tokens", buckets=TOKEN_LATENCY_BUCKETS)
e2e_request_latency = Histogram("pdserve_e2e_request_latency_seconds", "Request latency, arrival to last token", buckets=LATENCY_BUCKETS)
request_queue_time = Histogram("pdserve_request_queue_time_seconds", "Time a request waited in a queue", buckets=LATENCY_BUCKETS)
prefill_expected_wait = Histogram("pdserve_prefill_expected_wait_seconds",
                                  "A request's expected prefill wait (queued work ahead + its own) at admission",
                                  buckets=LATENCY_BUCKETS)
prefill_wait = Histogram("pdserve_prefill_wait_seconds", "A request's actual prefill wait: Prefill call to first token",
                         buckets=LATENCY_BUCKETS)
kv_transfer_seconds = Histogram("pdserve_kv_transfer_seconds", "One request's KV transfer, header to end", buckets=LATENCY_BUCKETS)


def serve_metrics(port: int, host: str = "127.0.0.1") -> int:
    """Starts the /metrics HTTP server (a daemon thread); 0 means off. Returns the port."""
    if not port:
        return 0
    server, _thread = start_http_server(port, addr=host)
    bound = server.server_address[1]
    log.info("Prometheus metrics on http://%s:%d/metrics", host, bound)
    return bound


def watch_kv_blocks(free: callable, total: callable) -> None:  # type: ignore[valid-type]
    """Reads the KV gauges from the live block pool at scrape time."""
    kv_blocks_total.set_function(lambda: total())
    kv_blocks_used.set_function(lambda: total() - free())
    kv_cache_usage_perc.set_function(lambda: (total() - free()) / total() if total() else 0.0)
