"""pdserve's structured output inside vLLM's sampler (`--engine vllm`): a vLLM v1 logits processor that holds a
matcher per constrained request of vLLM's batch and masks each step's logits by it.

vLLM's own structured outputs cannot serve a pdserve request: its grammar starts at vLLM's first output, but a
pdserve request reaches vLLM with the tokens already sampled (the prefill tier's first token, a migration's
outputs) at the end of its prompt. So the request carries its spec in `SamplingParams.extra_args[KEY]` with the
count of those tokens, and this processor compiles the spec with pdserve's `Grammars` (the checkpoint's
tokenizer), replays them, then follows vLLM's outputs (the batch's `output_tok_ids`, a live list) step by step.
A request vLLM preempts and re-adds is replayed again from its prompt's tail and its outputs. The decode
engine's own `Sequence.constraint` still decides the stop (grammar complete) on the tokens vLLM returns.

Runs where vLLM samples: the engine core's process, or each rank's under tensor parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.server.decode.sampler import apply_bitmask
from pdserve.server.model.config import load_config
from pdserve.server.structured.bitmask import unconstrained
from pdserve.server.structured.constraint import Constraint
from pdserve.server.structured.grammars import Grammars
from pdserve.server.structured.limits import SpecLimits

KEY = "pdserve_structured"
"""extra_args[KEY] = {"spec": the StructuredOutput's bytes in hex, "replay": outputs at the prompt's end}."""


def extra_args(spec: gen_pb.StructuredOutput, replay: int) -> dict:
    return {KEY: {"spec": spec.SerializeToString().hex(), "replay": replay}}


@dataclass
class _Row:
    constraint: Constraint
    outputs: list[int]
    """vLLM's output token ids of the request (the batch's live list)."""
    consumed: int = 0

    def catch_up(self) -> None:
        for token in self.outputs[self.consumed:]:
            self.constraint.advance(token)
        self.consumed = len(self.outputs)


class GrammarProcessor(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        model_dir = vllm_config.model_config.model
        config = load_config(model_dir)
        self.grammars = Grammars.for_model(model_dir, config.vocab_size, tuple(config.eos_token_ids),
                                           limits=SpecLimits.unbounded())  # the decode worker applied its own
        self.rows: dict[int, _Row] = {}
        """Batch index -> its constrained request's state."""

    def is_argmax_invariant(self) -> bool:
        return False  # it masks greedy rows too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is not None:
            for index in batch_update.removed:
                self.rows.pop(index, None)
            for index, params, prompt_ids, outputs in batch_update.added:
                self.rows.pop(index, None)
                asked = (params.extra_args or {}).get(KEY) if params is not None else None
                if asked and self.grammars is not None:  # (without grammars the engine refuses the request)
                    self.rows[index] = self._row(asked, prompt_ids or [], outputs)
            for a, b, direction in batch_update.moved:
                moving, there = self.rows.pop(a, None), self.rows.pop(b, None)
                if moving is not None:
                    self.rows[b] = moving
                if direction is MoveDirectionality.SWAP and there is not None:
                    self.rows[a] = there
        for row in self.rows.values():
            row.catch_up()

    def _row(self, asked: dict, prompt_ids: list[int], outputs: list[int]) -> _Row:
        spec = gen_pb.StructuredOutput.FromString(bytes.fromhex(asked["spec"]))
        n = int(asked["replay"])
        constraint = self.grammars.replayed(spec, list(prompt_ids[len(prompt_ids) - n:]) if n else [])
        return _Row(constraint, outputs)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V]: each constrained row's disallowed tokens at -inf, in one masked select."""
        if not self.rows:
            return logits
        indices = sorted(i for i in self.rows if i < logits.shape[0])
        masks = unconstrained(len(indices), logits.shape[-1])  # [R, ceil(V / 32)]
        for row, index in zip(masks, indices):
            self.rows[index].constraint.fill(row)
        at = torch.tensor(indices, device=logits.device)
        logits[at] = apply_bitmask(logits[at], torch.from_numpy(masks))
        return logits
