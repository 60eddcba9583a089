"""The vLLM logits processor that holds vLLM's batch to pdserve's grammars, against vLLM's batch-update
contract (removed, then added, then moved; outputs as live lists), with vLLM's interface module stood in where
vLLM is not installed (its three names, as vllm/v1/sample/logits_processor defines them)."""

from __future__ import annotations

import abc
import enum
import importlib
import sys
import types
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.server.model.config import load_config
from pdserve.server.structured.bitmask import unconstrained
from pdserve.server.structured.grammars import Grammars

REGEX = "[ab]{2,5}x"


def _interface() -> types.ModuleType:
    try:
        return importlib.import_module("vllm.v1.sample.logits_processor")
    except ImportError:
        module = types.ModuleType("vllm.v1.sample.logits_processor")

        class MoveDirectionality(enum.Enum):
            UNIDIRECTIONAL = enum.auto()
            SWAP = enum.auto()

        @dataclass(frozen=True)
        class BatchUpdate:
            batch_size: int
            removed: list
            added: list
            moved: list

        class LogitsProcessor(abc.ABC):
            pass

        module.MoveDirectionality, module.BatchUpdate, module.LogitsProcessor = \
            MoveDirectionality, BatchUpdate, LogitsProcessor
        return module


@pytest.fixture
def gp(monkeypatch):
    interface = _interface()
    monkeypatch.setitem(sys.modules, "vllm.v1.sample.logits_processor", interface)
    monkeypatch.delitem(sys.modules, "pdserve.server.decode.vllm.grammar_processor", raising=False)
    module = importlib.import_module("pdserve.server.decode.vllm.grammar_processor")
    return module, interface


def _params(module, spec: gen_pb.StructuredOutput | None, replay: int = 0):
    return SimpleNamespace(extra_args=None if spec is None else {**module.extra_args(spec, replay), "other": 1})


def test_constrained_rows_are_masked_by_their_grammar_after_the_replayed_outputs_and_follow_moves(gp, tiny_model):
    module, interface = gp
    path = tiny_model("llama")
    config = load_config(path)
    processor = module.GrammarProcessor(SimpleNamespace(model_config=SimpleNamespace(model=str(path))), "cpu", False)
    reference = Grammars.for_model(path, config.vocab_size, tuple(config.eos_token_ids))
    spec = gen_pb.StructuredOutput(regex=REGEX)
    a_id, b_id = reference.tokenizer.tokenize_str("a")[0], reference.tokenizer.tokenize_str("b")[0]

    def expected(outputs: list[int]) -> np.ndarray:
        c = reference.constraint(spec)
        c.replay(outputs)
        row = unconstrained(1, config.vocab_size)
        c.fill(row[0])
        return row[0]

    def masked(logits: torch.Tensor) -> list[np.ndarray]:
        return [np.packbits((logits[i] > -np.inf).numpy(), bitorder="little").view(np.int32) for i in range(3)]

    outputs0, outputs2 = [], []  # vLLM's live lists of the two constrained requests
    processor.update_state(interface.BatchUpdate(3, [], [
        (0, _params(module, spec, replay=1), [5, 6, a_id], outputs0),  # the prefill tier's first token: "a"
        (1, _params(module, None), [7], []),
        (2, _params(module, spec), [8], outputs2),
    ], []))
    rows = masked(processor.apply(torch.zeros(3, config.vocab_size)))
    assert (rows[0] == expected([a_id])).all() and (rows[2] == expected([])).all()
    assert (rows[1] == -1).all()
    assert not (expected([a_id, b_id]) == expected([])).all()  # "ab" taken, "x" may come: the masks tell states apart
    outputs0.append(b_id)  # vLLM sampled "b" for request 0
    processor.update_state(None)
    assert (masked(processor.apply(torch.zeros(3, config.vocab_size)))[0] == expected([a_id, b_id])).all()
    processor.update_state(interface.BatchUpdate(3, [], [], [(0, 2, interface.MoveDirectionality.SWAP)]))
    rows = masked(processor.apply(torch.zeros(3, config.vocab_size)))
    assert (rows[2] == expected([a_id, b_id])).all() and (rows[0] == expected([])).all()
    processor.update_state(interface.BatchUpdate(2, [2], [], [(0, 1, interface.MoveDirectionality.UNIDIRECTIONAL)]))
    assert sorted(processor.rows) == [1]
    logits = torch.randn(2, config.vocab_size)
    out = processor.apply(logits.clone())
    assert torch.equal(out[0], logits[0]) and (np.packbits((out[1] > -np.inf).numpy(), bitorder="little")
                                                .view(np.int32) == expected([])).all()


def test_a_request_without_the_key_is_left_alone(gp, tiny_model):
    module, interface = gp
    processor = module.GrammarProcessor(SimpleNamespace(model_config=SimpleNamespace(model=str(tiny_model("llama")))),
                                        "cpu", False)
    processor.update_state(interface.BatchUpdate(1, [], [(0, SimpleNamespace(extra_args=None), [3], [])], []))
    logits = torch.randn(1, 8)
    assert processor.rows == {} and processor.apply(logits) is logits
