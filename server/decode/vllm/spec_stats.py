"""vLLM's speculative-decoding counters on pdserve's /metrics (`--speculative-config` under --engine vllm).

vLLM's scheduler counts, per step, the sequences that verified a proposal, the tokens proposed and those
accepted (by position), and hands them to its stat loggers (`SchedulerStats.spec_decoding_stats`). This
logger adds them to the series the native engine's speculator counts (`metrics.spec_decode_*`, with
their vllm:* twins), so a dashboard reads both engines alike.

It stands in for vLLM's own Prometheus logger (vLLM adds that one unless a logger given to it is one):
vLLM's would register the vllm:* names pdserve already serves, in the same registry.
"""

from __future__ import annotations

from vllm.v1.metrics.loggers import PrometheusStatLogger

from pdserve.server import metrics


class SpecDecodeStats(PrometheusStatLogger):
    def __init__(self, vllm_config, engine_indexes: list[int] | None = None):  # registers nothing
        self.engine_indexes = engine_indexes or [0]

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        spec = getattr(scheduler_stats, "spec_decoding_stats", None)
        if spec is None or not spec.num_drafts:
            return
        metrics.spec_decode_num_drafts.inc(spec.num_drafts)
        metrics.spec_decode_num_draft_tokens.inc(spec.num_draft_tokens)
        metrics.spec_decode_num_accepted_tokens.inc(spec.num_accepted_tokens)
        for position, accepted in enumerate(spec.num_accepted_tokens_per_pos):
            if accepted:
                metrics.spec_decode_num_accepted_tokens_per_pos.labels(str(position)).inc(accepted)

    def record_sleep_state(self, is_awake: int = 0, level: int = 0) -> None:
        return

    def record_admission_rejection(self, reason: str) -> None:
        return

    def log_engine_initialized(self) -> None:
        return

    def log(self) -> None:
        return
