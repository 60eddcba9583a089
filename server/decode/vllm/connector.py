"""pdserve's KV connector for vLLM v1: the prompt KV a pdserve prefill worker pushed, loaded into vLLM's blocks.

Loaded by vLLM from `kv_transfer_config` (kv_connector="PdserveConnector",
kv_connector_module_path="pdserve.server.decode.vllm.connector", kv_role="kv_consumer"): its scheduler
side in the decode worker's own process (`engine.py`), where pdserve's receiver checked and staged the
KV; its worker side in every rank that runs the model (the same process with --tensor-parallel-size 1,
vLLM's T rank processes with T > 1).

Life of one request through the connector:
1. The engine seals the request's stage (`staging.py`) into `STAGED[vllm_id]` and adds the request
   (prompt + first token) with `kv_transfer_params={PARAMS_KEY: vllm_id}`.
2. Scheduler side: `get_num_new_matched_tokens` says every prompt token but the first token is loadable,
   synchronously (past vLLM's own prefix-cache hit, when its cache is on: with --kv-events-config); `update_state_after_alloc` takes the stage with the block ids vLLM gave the prompt (a
   table per KV cache group: the connector takes vLLM's hybrid allocator, whose sliding-window groups hold
   null blocks behind the window, where the prefill tier sent nothing: `KvLayout.stale_tokens`);
   `build_connector_meta` passes (block ids, stage) to every rank: for T > 1 the stage is a shared-memory
   file's path and its pieces' places, never the bytes.
3. Worker side, on every rank: `start_load_kv`, before the step's forward, reads the rank's own kv heads
   (`kv_head_range`: vLLM's split, replicated when T exceeds the kv heads) and writes them through each
   attention layer's own cache-update kernel into its group's blocks (`PagedKvWriter`). The step then
   computes only the first token's KV and samples the second. `build_connector_worker_meta` says which
   stages the rank read.
4. vLLM sums those reports over the ranks (`KVOutputAggregator`) before `update_connector_output`: once
   all T ranks read a stage it is released (its file unlinked) and counted. (`get_finished`'s
   finished_recving is for asynchronous loads only: vLLM asserts a request it names is waiting for
   remote KV or finished, and these loads are synchronous.)
5. A piece a rank cannot write reports its blocks through `get_block_ids_with_load_errors`; vLLM takes
   the union over ranks and its load-failure path recomputes them from the tokens. A request asked again
   (preempted) loads nothing: vLLM recomputes it. A request finished or aborted before it got blocks
   releases its stage in `request_finished_all_groups` (or the engine's abort).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from pdserve.server import metrics
from pdserve.server.decode.vllm.cache_groups import CacheGroups, layer_index
from pdserve.server.decode.vllm.kv_writer import NULL_BLOCK, PagedKvWriter
from pdserve.server.decode.vllm.staging import PendingReads, Staged

log = logging.getLogger("pdserve.decode.vllm")

PARAMS_KEY = "pdserve_kv"
"""The key in a request's kv_transfer_params naming its staged KV."""

STAGED: dict[str, Staged] = {}
"""vLLM request id -> its sealed stage, until the scheduler side takes it with the request's blocks (the
engine thread adds and drops entries; vLLM's scheduler runs on that thread too)."""


@dataclass
class KvLoad:
    block_ids: list[list[int]]
    """The prompt's blocks in token order, one list per KV cache group (null blocks behind a window)."""
    staged: Staged | None
    """None: nothing was staged for it (the load fails over to recomputation)."""
    skip_tokens: int = 0
    """Leading prompt tokens vLLM's prefix cache held (with --kv-events-config its cache is on): their blocks may
    be other requests' too, and hold this KV already; nothing is written there."""


@dataclass
class PdserveConnectorMetadata(KVConnectorMetadata):
    loads: dict[str, KvLoad] = field(default_factory=dict)
    """vLLM request id -> what to load into which blocks this step."""


@dataclass
class PdserveWorkerMetadata(KVConnectorWorkerMetadata):
    """What the ranks did with this step's loads; vLLM aggregates one per rank."""

    reads: dict[str, int] = field(default_factory=dict)
    """vLLM request id -> ranks done reading its stage (written or not)."""
    failed: set[str] = field(default_factory=set)
    """Requests some rank could not write (their blocks are recomputed)."""

    def aggregate(self, other: KVConnectorWorkerMetadata) -> PdserveWorkerMetadata:
        assert isinstance(other, PdserveWorkerMetadata)
        reads = {k: self.reads.get(k, 0) + other.reads.get(k, 0) for k in self.reads.keys() | other.reads.keys()}
        return PdserveWorkerMetadata(reads, self.failed | other.failed)


class PdserveConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        self._world = vllm_config.parallel_config.world_size  # ranks that each read every stage
        self._tp = vllm_config.parallel_config.tensor_parallel_size
        # scheduler side
        self._to_load: dict[str, KvLoad] = {}
        self._pending = PendingReads(self._world)  # stages sent to the ranks, until every rank read them
        self._asked: set[str] = set()  # requests that were offered external KV once
        # worker side
        self._writer: PagedKvWriter | None = None
        self._rank = 0
        self._load_errors: set[int] = set()
        self._reads = PdserveWorkerMetadata()

    # ---- scheduler side -------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if PARAMS_KEY not in params or request.request_id in self._asked:
            return 0, False
        # The last prompt token is pdserve's first sampled token: vLLM computes its KV and samples on.
        return max(0, len(request.prompt_token_ids) - 1 - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens > 0:  # vLLM adds a suffix to request ids: the params carry pdserve's key
            self._asked.add(request.request_id)
            key = request.kv_transfer_params[PARAMS_KEY]
            local = len(request.prompt_token_ids) - 1 - num_external_tokens  # vLLM's prefix-cache hit
            self._to_load[key] = KvLoad([list(ids) for ids in blocks.get_block_ids()], STAGED.pop(key, None), local)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        # Steps run one at a time: a stage still here from an earlier step was read by every rank whose
        # step returned, but no report said so (none should be left; never leak the file).
        for key in self._pending.release_all():
            log.warning("not every rank reported reading the KV of %s; released it", key)
        meta = PdserveConnectorMetadata(loads=self._to_load)
        for key, load in self._to_load.items():
            self._pending.sent(key, load.staged)
        self._to_load = {}
        return meta

    def update_connector_output(self, connector_output) -> None:
        report = connector_output.kv_connector_worker_meta
        if not isinstance(report, PdserveWorkerMetadata):
            return
        for key, ranks in report.reads.items():
            done, staged = self._pending.read(key, ranks)
            if not done:
                continue
            if key in report.failed or staged is None:
                metrics.vllm_kv_load_failures.inc()
            else:  # every layer of every prompt token (the receiver checked the stream was whole)
                metrics.vllm_kv_tokens_loaded.inc(staged.num_tokens)

    def request_finished_all_groups(self, request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, [])

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._asked.discard(request.request_id)
        staged = STAGED.pop((request.kv_transfer_params or {}).get(PARAMS_KEY), None)
        if staged is not None:  # finished or aborted before vLLM gave it blocks
            staged.release()
        return False, None

    # ---- worker side ----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed import get_tensor_model_parallel_rank

        self._rank = get_tensor_model_parallel_rank()

        layers = self._vllm_config.compilation_config.static_forward_context
        names = sorted(kv_caches, key=layer_index)
        groups = CacheGroups.of(self._kv_cache_config, len(names), self._block_size)
        self._writer = PagedKvWriter([layers[n] for n in names], [kv_caches[n] for n in names],
                                     list(groups.block_sizes), self._vllm_config.model_config.dtype,
                                     list(groups.layer_group))

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PdserveConnectorMetadata)
        for vllm_id, load in meta.loads.items():
            try:
                if load.staged is None:
                    raise KeyError(f"no staged KV for {vllm_id}")
                for piece in load.staged.read(self._rank, self._tp):
                    self._writer.write(load.block_ids, piece, load.skip_tokens)
            except Exception:
                log.exception("rank %d could not load the KV of %s into vLLM's blocks; vLLM recomputes them",
                              self._rank, vllm_id)
                self._load_errors.update(b for ids in load.block_ids for b in ids if b != NULL_BLOCK)
                self._reads.failed.add(vllm_id)
            self._reads.reads[vllm_id] = 1

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self._reads.reads:
            return None
        reads, self._reads = self._reads, PdserveWorkerMetadata()
        return reads

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv wrote every layer before the forward began

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # a kv_consumer saves nothing

    def wait_for_save(self) -> None:
        return
