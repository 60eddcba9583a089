"""Every Prometheus metric pdserve exports: its own `pdserve_*` series and, beside them, vLLM's names.

Every series carries `model_name` (the served model name, what vLLM's dashboards filter on) and
`role` (coordinator | prefill | decode), so a dashboard can tell the tiers apart and `sum()` over one
role never counts a request twice. A process names itself once, at start (`identify`); call sites
use the metrics as plain ones (`metrics.prompt_tokens.inc()`), the labels are added for them.

The `vllm:*` series mean what vLLM's do, with vLLM's types and buckets (vllm/v1/metrics/loggers.py),
so Grafana dashboards and autoscalers built for vLLM read pdserve unchanged. Each process serves the
ones it updates on `--metrics-port` (0: off). Gauges of live state (running requests, KV blocks) are
read when scraped, through `set_function`, so they are never stale.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, disable_created_metrics, start_http_server
from prometheus_client.metrics import MetricWrapperBase

log = logging.getLogger("pdserve")
disable_created_metrics()  # no *_created series: dashboards built for vLLM do not read them

IDENTITY = ("model_name", "role")
"""The labels on every series."""
_identity = {"model_name": "", "role": ""}

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                         1.0, 2.5, 5.0)
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0)
VLLM_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

FAMILIES: list[MetricWrapperBase] = []
"""Every metric family this module declares (pdserve's and vLLM's)."""


def _declare(cls: type, name: str, doc: str, labels: tuple[str, ...] = (), **kw: Any) -> MetricWrapperBase:
    metric = cls(name, doc, [*IDENTITY, *labels], **kw)
    FAMILIES.append(metric)
    return metric


class Series:
    """One or more metric families updated together (pdserve's and vLLM's of one meaning), each
    through its child labelled with this process's identity: `inc`, `observe`, `set_function`, ..."""

    def __init__(self, *families: MetricWrapperBase):
        self.families = families
        self._own: tuple[tuple[str, ...], tuple, _Children] | None = None
        """The children for this process's identity, looked up once (the per-token path uses them)."""

    def labels(self, *values: str) -> Series:
        """The children for the extra labels (after model_name and role)."""
        return _Children([f.labels(*_identity.values(), *values) for f in self.families])

    def __getattr__(self, method: str) -> Callable[..., None]:
        return getattr(self._children(), method)

    def observe_each(self, amount: float, count: int) -> None:
        """`count` observations of `amount` (a response's tokens, each `amount` after the one before):
        the same series as `count` calls of observe(amount), at the cost of one."""
        self._children().observe_each(amount, count)

    def _children(self) -> _Children:
        key = tuple(_identity.values())
        own = self._own
        if own is None or own[0] != key or own[1] is not self.families:  # identify() may replace families
            own = self._own = (key, self.families, _Children([f.labels(**_identity) for f in self.families]))
        return own[2]


class _Children:
    def __init__(self, children: list):
        self.children = children

    def __getattr__(self, method: str) -> Callable[..., None]:
        bound = [getattr(child, method) for child in self.children]

        def call(*args: Any, **kwargs: Any) -> None:
            for f in bound:
                f(*args, **kwargs)

        setattr(self, method, call)  # found in the instance from now on: no closure per call
        return call

    def observe_each(self, amount: float, count: int) -> None:
        for child in self.children:
            _observe_each(child, amount, count)


def _observe_each(histogram: Any, amount: float, count: int) -> None:
    """`count` observations of `amount` on one histogram child: what `count` observe() calls add (one bucket
    by `count`, the sum by `amount * count`; prometheus_client's own fields, pinned by tests/test_metrics.py)."""
    if count == 1:
        histogram.observe(amount)
        return
    if count < 1:
        return
    histogram._raise_if_not_observable()
    histogram._sum.inc(amount * count)
    for i, bound in enumerate(histogram._upper_bounds):
        if amount <= bound:
            histogram._buckets[i].inc(count)
            break


def _pd(cls: type, name: str, doc: str, labels: tuple[str, ...] = (), *, vllm: str | None = None,
        vllm_buckets: tuple[float, ...] | None = None, vllm_old: str | None = None, **kw: Any) -> Series:
    """pdserve_<name>, and vllm:<vllm> with the same meaning when given; vllm:<vllm_old> too, the older name
    vLLM gave the same series (published dashboards still query it)."""
    families = [_declare(cls, f"pdserve_{name}", doc, labels, **kw)]
    if vllm_buckets is not None:
        kw = {**kw, "buckets": vllm_buckets}
    for vllm_name in (vllm, vllm_old):
        if vllm_name is not None:
            families.append(_declare(cls, f"vllm:{vllm_name}", doc, labels, **kw))
    return Series(*families)


# ---- state (gauges) ------------------------------------------------------------
num_requests_running = _pd(Gauge, "num_requests_running", "Requests running (decoding, or prefilling on a prefill worker)",
                           vllm="num_requests_running")
num_requests_waiting = _pd(Gauge, "num_requests_waiting", "Requests waiting (in a queue, or for their KV)",
                           vllm="num_requests_waiting")
kv_cache_usage_perc = _pd(Gauge, "kv_cache_usage_perc", "KV cache usage: 0 is empty, 1 is full", vllm="kv_cache_usage_perc",
                          vllm_old="gpu_cache_usage_perc")
kv_blocks_used = _pd(Gauge, "kv_blocks_used", "KV cache blocks in use")
kv_blocks_total = _pd(Gauge, "kv_blocks_total", "KV cache blocks in all")
prefill_queued_tokens = _pd(Gauge, "prefill_queued_tokens", "Prompt tokens waiting to be prefilled")
prefill_queued_seconds = _pd(Gauge, "prefill_queued_seconds",
                             "Seconds of prefill work queued, at the measured rate per length bucket")
prefill_padding_share = _pd(Gauge, "prefill_padding_share",
                            "Share of the prefill steps' token slots that held padding, since start (0 to 1)")
prefill_compiles_pending = _pd(Gauge, "prefill_compiles_pending",
                               "Start-up programs (step shapes, samplers) the prefill worker has still to compile "
                               "while it serves; 0 once every shape is compiled")
prefill_programs_compiled = _pd(Gauge, "prefill_programs_compiled",
                                "Start-up programs (step shapes, samplers) the prefill worker has compiled; its steps "
                                "pack only into those")
prefill_programs_total = _pd(Gauge, "prefill_programs_total",
                             "Start-up programs (step shapes, samplers) the prefill worker compiles in all")

# ---- outcomes (counters) ---------------------------------------------------------
request_success = _pd(Counter, "request_success", "Requests that finished, by finish reason", ("finished_reason",),
                      vllm="request_success")
request_failure = _pd(Counter, "request_failure", "Requests that ended with an error status, by code", ("code",))
prompt_tokens = _pd(Counter, "prompt_tokens", "Prompt tokens processed", vllm="prompt_tokens")
generation_tokens = _pd(Counter, "generation_tokens", "Tokens generated", vllm="generation_tokens")
kv_transfer_bytes = _pd(Counter, "kv_transfer_bytes", "KV bytes transferred (sent by prefill, received by decode)")
kv_transfer_failures = _pd(Counter, "kv_transfer_failures", "KV transfers that failed (push refused or broken, or never arrived)")
prefill_retries = _pd(Counter, "prefill_retries", "Prefills retried on another worker")
prefill_prefix_cache_hits = _pd(Counter, "prefill_prefix_cache_hit_tokens",
                                "Prompt tokens a prefill worker took from its prefix KV instead of computing")
prefill_computed_tokens = _pd(Counter, "prefill_computed_tokens",
                              "Prompt tokens a worker computed: a prefill worker (those from its prefix KV are not), "
                              "or a decode worker's local prefill (past the blocks its prefix cache held)")
conditional_disagg = _pd(Counter, "conditional_disagg",
                         "Prompts the coordinator let a decode worker prefill itself when it held all but a short "
                         "suffix (--conditional-disagg-max-uncached), by where they were prefilled: local (the "
                         "decode worker) or remote (the prefill tier)", ("where",))
uncached_prompt_tokens = _pd(Counter, "uncached_prompt_tokens",
                             "Prompt tokens past the blocks the decode worker had cached, by the tier that prefilled "
                             "them: decode (a local prefill) or prefill (which may take more from its own prefix KV)",
                             ("tier",))
prefill_compile_waits = _pd(Counter, "prefill_compile_waits",
                            "Prefill steps that waited for a program to compile (0 while every step packs into "
                            "compiled shapes)")
shared_prompt_choices = _pd(Counter, "shared_prompt_choices",
                            "Choices after the first of requests with n > 1, by where they went: shared (choice 0's "
                            "decode worker, reusing its prompt KV) or own (it had no room, or choice 0 placed none)",
                            ("route",))
migrations = _pd(Counter, "migrations", "Requests moved to another decode worker mid-stream")
routing_decisions = _pd(Counter, "routing_decisions",
                        "Workers the coordinator picked, by tier and why: kv-index (the KV index says it holds the "
                        "prompt's longest prefix, at the least expected cost), kv-load (the index knows no worker holding "
                        "any of it: by load), queue (none has room now: the shortest worker queue), kv-index-partial (either, on a view known incomplete), shared-prompt (n > 1: "
                        "choice 0's), rendezvous (no KV index: prefix-aware's hash), or the policy's name", ("tier", "reason"))
kv_index_resyncs = _pd(Counter, "kv_index_resyncs",
                       "Gaps in a worker's KV event sequence, by outcome: replayed (its replay endpoint filled them) or "
                       "partial (it could not: the view was emptied and is a subset of what the worker holds)",
                       ("outcome",))
kv_index_blocks = _pd(Gauge, "kv_index_blocks", "Block hashes in the coordinator's KV index, every worker's view together")
kv_index_workers = _pd(Gauge, "kv_index_workers",
                       "Workers whose KV events the coordinator reads, by the state of its view: syncing (snapshot "
                       "pending), live (exact as of the last batch), partial (known incomplete)", ("state",))
vllm_kv_tokens_loaded = _pd(Counter, "vllm_kv_tokens_loaded",
                            "Prompt tokens whose KV the connector wrote into vLLM's cache")
vllm_kv_load_failures = _pd(Counter, "vllm_kv_load_failures",
                            "Requests whose pushed KV vLLM could not load (it recomputed them)")
lora_requests = _pd(Counter, "lora_requests", "Requests a decode worker took for each LoRA adapter (base-model "
                    "requests are not counted)", ("lora_name",))
lora_load_seconds = _pd(Histogram, "lora_load_seconds", "LoRA adapter loads from disk (read, checked, packed for "
                        "the fused matmuls), each also logged in ms", buckets=LATENCY_BUCKETS)
local_prefill_fallbacks = _pd(Counter, "local_prefill_fallbacks", "Prompts prefilled on a decode worker (no prefill worker alive)")
num_preemptions = _pd(Counter, "num_preemptions", "Decode sequences preempted (blocks freed, re-prefilled later)",
                      vllm="num_preemptions")
prefix_cache_queries = _pd(Counter, "prefix_cache_queries", "Tokens looked up in the decode prefix cache",
                           vllm="prefix_cache_queries")
prefix_cache_hits = _pd(Counter, "prefix_cache_hits", "Tokens found in the decode prefix cache (KV not sent again)",
                        vllm="prefix_cache_hits")
admission_rejections = _pd(Counter, "admission_rejections", "Requests refused because a tier's queue was full", ("tier",))
expected_wait_rejections = _pd(Counter, "expected_wait_rejections",
                               "Requests refused because their expected prefill wait exceeded the deadline or TTFT budget")
stalled_streams = _pd(Counter, "stalled_streams", "Decode streams that sent nothing for --stall-timeout and migrated")
cuda_graph_capture_failures = _pd(Counter, "cuda_graph_capture_failures",
                                  "Decode batch buckets whose CUDA graph failed to capture (those batches run eagerly)")
spec_decode_num_drafts = _pd(Counter, "spec_decode_num_drafts",
                             "Speculative decoding: sequences that verified a proposal, one per step each",
                             vllm="spec_decode_num_drafts")
spec_decode_num_draft_tokens = _pd(Counter, "spec_decode_num_draft_tokens", "Speculative decoding: tokens proposed",
                                   vllm="spec_decode_num_draft_tokens")
spec_decode_num_accepted_tokens = _pd(Counter, "spec_decode_num_accepted_tokens",
                                      "Speculative decoding: proposed tokens accepted",
                                      vllm="spec_decode_num_accepted_tokens")
spec_decode_num_accepted_tokens_per_pos = _pd(Counter, "spec_decode_num_accepted_tokens_per_pos",
                                              "Speculative decoding: proposed tokens accepted, by their position in "
                                              "the proposal (0: the first)", ("position",),
                                              vllm="spec_decode_num_accepted_tokens_per_pos")
decode_refusals = _pd(Counter, "decode_refusals", "Decode workers refusing a request for lack of room (another replica took the blocks); picked again")
grammar_checks = _pd(Counter, "grammar_checks", "Structured-output specs checked in a grammar child process, by outcome "
                     "(passed, refused, limit: over a --max-* limit before any native work, crash, timeout, error)",
                     ("outcome",))
grammar_cache_hits = _pd(Counter, "grammar_cache_hits", "Compiled grammars found in the worker's cache")
grammar_cache_misses = _pd(Counter, "grammar_cache_misses", "Grammars compiled because the worker's cache lacked them")
grammar_cache_evictions = _pd(Counter, "grammar_cache_evictions",
                              "Compiled grammars evicted from the worker's cache to stay within --grammar-cache-bytes")
grammar_cache_bytes = _pd(Gauge, "grammar_cache_bytes", "Estimated bytes of the compiled grammars a worker caches")


class _OfRole(Series):
    """A series about other processes (`pdserve up`'s supervisor counting restarts): `labels(role)`
    names the role the series is about, not this process's."""

    def labels(self, *values: str) -> Series:
        return _Children([f.labels(_identity["model_name"], *values) for f in self.families])


worker_restarts = _OfRole(_declare(Counter, "pdserve_worker_restarts",
                                   "Processes `pdserve up` started again after they died, by their role"))
_LAZY = {id(f) for f in worker_restarts.families}
"""Families whose series appear when first counted, not at `identify`."""

# ---- latency (histograms) -----------------------------------------------------------
time_to_first_token = _pd(Histogram, "time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS,
                          vllm="time_to_first_token_seconds", vllm_buckets=VLLM_TTFT_BUCKETS)
inter_token_latency = _pd(Histogram, "inter_token_latency_seconds", "Time between output tokens",
                          buckets=TOKEN_LATENCY_BUCKETS, vllm="inter_token_latency_seconds", vllm_buckets=VLLM_ITL_BUCKETS,
                          vllm_old="time_per_output_token_seconds")
e2e_request_latency = _pd(Histogram, "e2e_request_latency_seconds", "Request latency, arrival to last token",
                          buckets=LATENCY_BUCKETS, vllm="e2e_request_latency_seconds",
                          vllm_buckets=VLLM_REQUEST_LATENCY_BUCKETS)
request_queue_time = _pd(Histogram, "request_queue_time_seconds", "Time a request waited in a queue",
                         buckets=LATENCY_BUCKETS, vllm="request_queue_time_seconds",
                         vllm_buckets=VLLM_REQUEST_LATENCY_BUCKETS)
# A request's phases, as vLLM splits them: scheduled is when it left the coordinator's queue with its workers
# picked (its first attempt); prefill runs to the first token, decode from there to the last.
request_prefill_time = _pd(Histogram, "request_prefill_time_seconds", "A request's prefill phase: scheduled to first token",
                           buckets=LATENCY_BUCKETS, vllm="request_prefill_time_seconds",
                           vllm_buckets=VLLM_REQUEST_LATENCY_BUCKETS)
request_decode_time = _pd(Histogram, "request_decode_time_seconds", "A request's decode phase: first token to last",
                          buckets=LATENCY_BUCKETS, vllm="request_decode_time_seconds",
                          vllm_buckets=VLLM_REQUEST_LATENCY_BUCKETS)
request_inference_time = _pd(Histogram, "request_inference_time_seconds", "A request's prefill and decode: scheduled to last token",
                             buckets=LATENCY_BUCKETS, vllm="request_inference_time_seconds",
                             vllm_buckets=VLLM_REQUEST_LATENCY_BUCKETS)
request_time_per_output_token = _pd(Histogram, "request_time_per_output_token_seconds",
                                    "A request's mean time per output token after the first (its decode phase over its "
                                    "output tokens less one); requests of one token observe nothing",
                                    buckets=TOKEN_LATENCY_BUCKETS, vllm="request_time_per_output_token_seconds",
                                    vllm_buckets=VLLM_ITL_BUCKETS)
prefill_expected_wait = _pd(Histogram, "prefill_expected_wait_seconds",
                            "An admitted request's expected prefill wait at admission: the work its prefill worker runs first, then its own",
                            buckets=LATENCY_BUCKETS)
prefill_wait = _pd(Histogram, "prefill_wait_seconds", "A request's actual prefill wait: Prefill call to first token",
                   buckets=LATENCY_BUCKETS)
kv_transfer_seconds = _pd(Histogram, "kv_transfer_seconds", "One request's KV transfer, header to end", buckets=LATENCY_BUCKETS)
kv_index_event_lag = _pd(Histogram, "kv_index_event_lag_seconds",
                         "A live KV event batch's age when the coordinator's index applied it (its timestamp to now)",
                         buckets=LATENCY_BUCKETS)

# ---- per request, in tokens (vLLM's; buckets 1-2-5 up to max_model_len, made by `identify`) ----
request_prompt_tokens = Series()
"""vllm:request_prompt_tokens: one observation per finished request."""
request_generation_tokens = Series()
request_params_max_tokens = Series()


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_value:
                return tuple(out)
            out.append(value)
        exponent += 1


_TOKEN_HISTOGRAMS = {
    "request_prompt_tokens": "Number of prefill tokens processed.",
    "request_generation_tokens": "Number of generation tokens processed.",
    "request_params_max_tokens": "Histogram of the max_tokens request parameter.",
}


def identify(model_name: str, role: str, max_model_len: int = 0, *, at_zero: bool = True) -> None:
    """Names this process on every series; `max_model_len` sizes the token-count histograms. at_zero: the
    series without further labels exist from now on, at 0 (False: `pdserve up`'s supervisor, which counts
    only restarts and would add a 0 of every gauge to the workers' series it serves beside its own)."""
    _identity.update(model_name=model_name, role=role)
    if max_model_len:
        buckets = build_1_2_5_buckets(max_model_len)
        for attr, doc in _TOKEN_HISTOGRAMS.items():
            series: Series = globals()[attr]
            old = series.families[0] if series.families else None
            if old is not None and tuple(old._upper_bounds[:-1]) == buckets:
                continue
            if old is not None:  # a second identity in one process (tests): new buckets, new family
                REGISTRY.unregister(old)
                FAMILIES.remove(old)
            series.families = (_declare(Histogram, f"vllm:{attr}", doc, buckets=buckets),)
    for family in FAMILIES if at_zero else ():  # the series without further labels exist from the start, at 0
        if tuple(family._labelnames) == IDENTITY and id(family) not in _LAZY:
            family.labels(**_identity)


def serve_metrics(port: int, host: str = "127.0.0.1") -> int:
    """Starts the /metrics HTTP server (a daemon thread); 0 means off. Returns the port."""
    if not port:
        return 0
    server, _thread = start_http_server(port, addr=host)
    bound = server.server_address[1]
    log.info("Prometheus metrics on http://%s:%d/metrics", host, bound)
    return bound


def watch_kv_blocks(free: Callable[[], int], total: Callable[[], int]) -> None:
    """Reads the KV gauges from the live block pool at scrape time."""
    kv_blocks_total.set_function(lambda: total())
    kv_blocks_used.set_function(lambda: total() - free())
    kv_cache_usage_perc.set_function(lambda: (total() - free()) / total() if total() else 0.0)


_offload_stats: list[Callable[[], tuple[dict[str, dict[str, int]], int]]] = []
"""The offload tiers' counters by tier and the saves dropped, read at scrape time (`watch_kv_offload`)."""
_OFFLOAD_COUNTERS = {
    "hits": "KV blocks loaded from an offload tier", "misses": "KV blocks an offload tier lacked",
    "bytes_read": "KV bytes read from an offload tier", "bytes_written": "KV bytes written to an offload tier",
    "saves": "KV blocks saved to an offload tier", "evictions": "KV blocks an offload tier evicted",
    "rejected": "KV blocks that failed their checksum or length when read (dropped: a miss)",
    "save_errors": "KV block saves an offload tier could not write (a full disk: a miss later)",
}


class _OffloadCollector:
    """pdserve_kv_offload_* series, one per tier (host, disk, shared), from the live `TieredStore`."""

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        if not _offload_stats:
            return
        tiers, drops = _offload_stats[0]()
        names = [*IDENTITY, "tier"]
        for key, doc in _OFFLOAD_COUNTERS.items():
            family = CounterMetricFamily(f"pdserve_kv_offload_{key}", doc, labels=names)
            for tier, stats in tiers.items():
                family.add_metric([_identity["model_name"], _identity["role"], tier], stats[key])
            yield family
        used = GaugeMetricFamily("pdserve_kv_offload_used_bytes", "Bytes an offload tier holds", labels=names)
        for tier, stats in tiers.items():
            used.add_metric([_identity["model_name"], _identity["role"], tier], stats["used_bytes"])
        yield used
        dropped = CounterMetricFamily("pdserve_kv_offload_save_drops", "KV block saves dropped because too many "
                                      "waited (a miss later)", labels=list(IDENTITY))
        dropped.add_metric([_identity["model_name"], _identity["role"]], drops)
        yield dropped


REGISTRY.register(_OffloadCollector())


def watch_kv_offload(stats: Callable[[], tuple[dict[str, dict[str, int]], int]]) -> None:
    """Exports the offload tiers' counters (`TieredStore.stats()`, its save drops) at scrape time."""
    _offload_stats[:] = [stats]


_lora_state: list[tuple[int, Callable[[], tuple[list[str], list[str]]]]] = []
"""--max-loras and the adapters of the running and the waiting requests, read at scrape time (`watch_lora`)."""


class _LoraInfoCollector:
    """vllm:lora_requests_info as vLLM 0.32 defines it (vllm/v1/metrics/loggers.py): a gauge whose value is the
    time it was read (vLLM's set_to_current_time) and whose labels carry the state, max_lora (--max-loras),
    waiting_lora_adapters and running_lora_adapters (the adapters' names, comma-joined in the order their first
    request came, "" for none); beside this process's identity. Read live at each scrape: one series, never a stale
    one (vLLM's keeps every past label set, a reader takes the newest)."""

    def collect(self):
        import time

        from prometheus_client.core import GaugeMetricFamily

        if not _lora_state:
            return
        max_loras, state = _lora_state[0]
        running, waiting = state()
        family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                   labels=[*IDENTITY, "max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        family.add_metric([_identity["model_name"], _identity["role"], str(max_loras), ",".join(waiting),
                           ",".join(running)], time.time())
        yield family


REGISTRY.register(_LoraInfoCollector())


def watch_lora(max_loras: int, state: Callable[[], tuple[list[str], list[str]]]) -> None:
    """Exports vllm:lora_requests_info (--enable-lora only, as vLLM): state() -> (the adapters of the running
    requests, those of the waiting ones), each name once."""
    _lora_state[:] = [(max_loras, state)]
