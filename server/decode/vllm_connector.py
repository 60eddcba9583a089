"""pdserve's KV connector for vLLM v1: the prompt KV a pdserve prefill worker pushed, loaded into vLLM's blocks.

Loaded by vLLM from `kv_transfer_config` (kv_connector="PdserveConnector",
kv_connector_module_path="pdserve.server.decode.vllm_connector", kv_role="kv_consumer") in the decode
worker's own process (`vllm_engine`), where pdserve's receiver has already checked and staged the KV.

Life of one request through the connector:
1. The engine stages the request's pieces in `STAGED[vllm_id]` and adds the request (prompt + first token)
   with `kv_transfer_params={PARAMS_KEY: vllm_id}`.
2. Scheduler side: `get_num_new_matched_tokens` says every prompt token but the first token is loadable,
   synchronously; `update_state_after_alloc` records the block ids vLLM took for them;
   `build_connector_meta` passes (vllm_id, block ids) to the worker side.
3. Worker side: `start_load_kv`, before the step's forward, writes the staged pieces into those blocks
   through each attention layer's own cache-update kernel (`PagedKvWriter`). The step then computes only
   the first token's KV and samples the second.
4. A piece that cannot be written reports its blocks through `get_block_ids_with_load_errors`: vLLM's
   load-failure path recomputes them from the tokens. A request asked again (preempted) loads nothing:
   vLLM recomputes it.
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
)

from pdserve.kvcache.codec import KvPiece
from pdserve.server import metrics
from pdserve.server.decode.vllm_kv_writer import PagedKvWriter

log = logging.getLogger("pdserve.decode.vllm")

PARAMS_KEY = "pdserve_kv"
"""The key in a request's kv_transfer_params naming its staged KV."""

STAGED: dict[str, list[KvPiece]] = {}
"""vLLM request id -> the prompt KV pieces waiting to be written (the engine thread adds and drops them)."""


@dataclass
class PdserveConnectorMetadata(KVConnectorMetadata):
    loads: dict[str, list[int]] = field(default_factory=dict)
    """vLLM request id -> the block ids of its prompt, in token order."""


class PdserveConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._block_size = vllm_config.cache_config.block_size
        self._to_load: dict[str, list[int]] = {}
        self._asked: set[str] = set()  # requests that were offered external KV once
        self._writer: PagedKvWriter | None = None
        self._load_errors: set[int] = set()

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
            self._to_load[request.kv_transfer_params[PARAMS_KEY]] = list(blocks.get_block_ids()[0])

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = PdserveConnectorMetadata(loads=self._to_load)
        self._to_load = {}
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._asked.discard(request.request_id)
        return False, None

    # ---- worker side ----------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        layers = self._vllm_config.compilation_config.static_forward_context
        names = sorted(kv_caches, key=extract_layer_index)
        self._writer = PagedKvWriter([layers[n] for n in names], [kv_caches[n] for n in names], self._block_size,
                                     self._vllm_config.model_config.dtype)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PdserveConnectorMetadata)
        for vllm_id, block_ids in meta.loads.items():
            pieces = STAGED.pop(vllm_id, None)
            try:
                if pieces is None:
                    raise KeyError(f"no staged KV for {vllm_id}")
                for piece in pieces:
                    self._writer.write(block_ids, piece)
            except Exception:
                log.exception("could not load the KV of %s into vLLM's blocks; vLLM recomputes them", vllm_id)
                self._load_errors.update(block_ids)
                metrics.vllm_kv_load_failures.inc()
            else:  # every layer of every prompt token (pdserve's receiver checked the stream was whole)
                metrics.vllm_kv_tokens_loaded.inc(max(p.token_start + p.num_tokens for p in pieces) if pieces else 0)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv wrote every layer before the forward began

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # a kv_consumer saves nothing

    def wait_for_save(self) -> None:
        return
