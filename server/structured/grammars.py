"""Compiled grammars for one tokenizer, cached by a hash of (grammar, tokenizer); compiling bounded in time
and run off the event loop (`prepare`).

A worker holds one `Grammars` for its model. `prepare(spec)` compiles in a thread (llguidance drops the GIL),
within `timeout` seconds and llguidance's parser limits, and refuses a spec that does not compile with
SpecError naming the field; `constraint(spec)` then hands a sequence its own matcher, a copy of the cached one
(compiling first if it was not prepared). The LLTokenizer is built once, on first use.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections import OrderedDict
from pathlib import Path

import llguidance

from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.server.structured.constraint import Constraint
from pdserve.server.structured.lltokenizer import ll_tokenizer
from pdserve.server.structured.spec import SpecError, grammar_of, kind_of, one_line

DEFAULT_TIMEOUT_S = 10.0
MAX_CACHED = 256
LIMITS = dict(max_grammar_size=1_000_000, initial_lexer_fuel=20_000_000)
"""llguidance's parser limits: a grammar over them fails to compile (a refusal), never stalls a worker."""


class Grammars:
    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: tuple[int, ...],
                 timeout: float = DEFAULT_TIMEOUT_S, field: str = "sampling.structured"):
        """tokenizer_json: the model's tokenizer.json; vocab_size: the logits' width (the mask's); eos_ids:
        what a complete grammar allows next."""
        self._json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.timeout = timeout
        self.field = field
        self.digest = hashlib.sha256(tokenizer_json.encode()).hexdigest()[:16]
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._num_tokens = 0
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def for_model(cls, model_dir: str | Path, vocab_size: int, eos_ids: tuple[int, ...], **kwargs) -> Grammars | None:
        """The checkpoint's grammars; None (structured requests refused, naming the field) when it has no
        tokenizer.json to compile them with (a weights-only checkpoint served from token ids)."""
        path = Path(model_dir) / "tokenizer.json"
        if not path.exists():
            return None
        return cls(path.read_text(), vocab_size, eos_ids, **kwargs)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                from tokenizers import Tokenizer

                self._num_tokens = min(Tokenizer.from_str(self._json).get_vocab_size(with_added_tokens=True),
                                       self.vocab_size)
                self._tokenizer = ll_tokenizer(self._json, self.vocab_size, self.eos_ids)
            return self._tokenizer

    def warm(self) -> threading.Thread:
        """Builds the LLTokenizer in a daemon thread (a second or more for a 150k vocabulary), so the first
        structured request does not wait for it; returns the thread."""
        thread = threading.Thread(target=lambda: self.tokenizer, daemon=True, name="grammars-tokenizer")
        thread.start()
        return thread

    def key(self, grammar: str) -> str:
        """The cache key: a hash of the grammar and the tokenizer."""
        return hashlib.sha256(f"{self.digest}\0{grammar}".encode()).hexdigest()

    def compiled(self, spec: gen_pb.StructuredOutput) -> llguidance.LLMatcher:
        """The spec's matcher in its initial state, from the cache or compiled now (blocking)."""
        grammar = grammar_of(spec, self.field)
        key = self.key(grammar)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0,
                                       limits=llguidance.LLParserLimits(**LIMITS))
        if matcher.is_error():
            raise SpecError(f"{self.field}.{kind_of(spec)}: {one_line(matcher.get_error())}")
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > MAX_CACHED:
                self._cache.popitem(last=False)
        return matcher

    def is_cached(self, spec: gen_pb.StructuredOutput) -> bool:
        return self.key(grammar_of(spec, self.field)) in self._cache

    async def prepare(self, spec: gen_pb.StructuredOutput) -> None:
        """Compiles the spec in a thread, within `timeout`; SpecError if it does not compile in time."""
        if self.is_cached(spec):
            return
        try:
            await asyncio.wait_for(asyncio.to_thread(self.compiled, spec), self.timeout)
        except TimeoutError as e:
            raise SpecError(f"{self.field}.{kind_of(spec)}: the grammar did not compile within "
                            f"{self.timeout:g} s") from e

    def constraint(self, spec: gen_pb.StructuredOutput) -> Constraint | None:
        """A sequence's own matcher for the spec (None: no spec set)."""
        if kind_of(spec) is None:
            return None
        return Constraint(self.compiled(spec).deep_copy(), self._num_tokens)

    def replayed(self, spec: gen_pb.StructuredOutput, outputs: list[int]) -> Constraint | None:
        """A sequence's matcher after the outputs it already has (a migration's, or the prefill tier's first
        token); ValueError naming the field when the spec does not compile or the outputs do not fit it."""
        try:
            constraint = self.constraint(spec)
        except SpecError as e:
            raise ValueError(str(e)) from e
        if constraint is not None:
            constraint.replay(outputs)
        return constraint


def request_constraint(grammars: Grammars | None, request) -> Constraint | None:
    """A decode request's matcher (pb.DecodeRequest: the outputs before a migration, its prompt's last
    num_output_tokens, replayed), for either decode engine; ValueError if it cannot be enforced."""
    spec = request.sampling.structured
    if not spec.WhichOneof("kind"):
        return None
    if grammars is None:
        raise ValueError("sampling.structured: this decode worker has no tokenizer to compile grammars with")
    n = request.num_output_tokens
    return grammars.replayed(spec, list(request.prompt_token_ids[len(request.prompt_token_ids) - n:]) if n else [])
