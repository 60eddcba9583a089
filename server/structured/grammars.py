"""Compiled grammars for one tokenizer, in a byte-bounded LRU keyed by a hash of (spec, tokenizer); a spec
is compiled here only after a child process passed it, on this object's own bounded executor.

A worker holds one `Grammars` for its model. `prepare(spec)` (async) first has a grammar child (pool.py,
checker.py) check the spec within the limits (limits.py) and trial-compile it against the tokenizer, so a spec
that crashes or stalls llguidance kills only that child and is refused with SpecError; then it compiles the
spec in this process on a small dedicated thread pool (never the executor the decode steps share), within
`timeout` seconds. `for_request(request)` then hands a sequence its own matcher, a copy of the cached one,
after the outputs it already has (the one replay rule of both tiers). Compiling on demand without `prepare`
(`compiled`, `constraint`) checks in a child too, blocking the caller. The LLTokenizer is built once, on
first use. Nothing about a refused spec is cached.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import threading
from collections import OrderedDict
from pathlib import Path

import llguidance
from pdserve.server import metrics
from pdserve.server.structured.checker import SpecChecker
from pdserve.server.structured.constraint import Constraint
from pdserve.server.structured.limits import SpecLimits
from pdserve.server.structured.lltokenizer import ll_tokenizer
from pdserve.server.structured.output_spec import SpecError, grammar_of, kind_of, one_line
from pdserve.server.structured.pool import DEFAULT_PROCESSES, shared_pool
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import worker_pb2 as pb

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_CACHE_BYTES = 512 * 2**20
COMPILE_THREADS = 2
COMPILE_STACK_BYTES = 16 * 2**20
"""The compile threads' stack: four times a grammar child's (child.py), so what passed there fits here."""
MATCHER_BASE_BYTES = 128 * 1024
MATCHER_BYTES_PER_GRAMMAR_BYTE = 80
"""A compiled matcher's size, estimated as MATCHER_BASE_BYTES + 80 x its grammar text's length: measured as
the resident-memory growth of 30 matchers each (after their first mask) of JSON schemas of 2.7 KB to 260 KB
over a 29k-token byte-level BPE vocabulary: 0.12 MB to 18 MB each, 44 to 74 bytes per grammar byte (the
vocabulary's token trie is the LLTokenizer's, shared by every matcher)."""
LIMITS = dict(max_grammar_size=1_000_000, initial_lexer_fuel=20_000_000)
"""llguidance's parser limits: a grammar over them fails to compile (a refusal), never stalls a worker."""

_STACK_LOCK = threading.Lock()


class _CompileThreads(concurrent.futures.ThreadPoolExecutor):
    """A bounded thread pool whose threads have COMPILE_STACK_BYTES stacks (a thread starts inside submit)."""

    def submit(self, fn, /, *args, **kwargs):
        with _STACK_LOCK:
            previous = threading.stack_size(COMPILE_STACK_BYTES)
            try:
                return super().submit(fn, *args, **kwargs)
            finally:
                threading.stack_size(previous)


def matcher_bytes(grammar: str) -> int:
    """The estimated memory of a compiled grammar's matcher (see MATCHER_BYTES_PER_GRAMMAR_BYTE)."""
    return MATCHER_BASE_BYTES + MATCHER_BYTES_PER_GRAMMAR_BYTE * len(grammar)


class Grammars:
    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: tuple[int, ...],
                 timeout: float = DEFAULT_TIMEOUT_S, field: str = "sampling.structured", *,
                 limits: SpecLimits | None = None, processes: int = DEFAULT_PROCESSES,
                 cache_bytes: int = DEFAULT_CACHE_BYTES, isolated: bool = True):
        """tokenizer_json: the model's tokenizer.json; vocab_size: the logits' width (the mask's); eos_ids:
        what a complete grammar allows next; timeout: a check's and a compile's deadline; processes: grammar
        children (shared by every Grammars of this tokenizer); cache_bytes: the compiled grammars' budget;
        isolated=False: compile without a child's check (only inside a grammar child itself)."""
        if cache_bytes < 0:
            raise ValueError(f"--grammar-cache-bytes must be >= 0, got {cache_bytes}")
        self._json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.timeout = timeout
        self.field = field
        self.digest = hashlib.sha256(tokenizer_json.encode()).hexdigest()[:16]
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._num_tokens = 0
        self._cache: OrderedDict[str, tuple[llguidance.LLMatcher, int]] = OrderedDict()
        """key -> (matcher, its estimated bytes), least recently used first."""
        self.cache_bytes = cache_bytes
        self.cached_bytes = 0
        self.hits = self.misses = self.evictions = 0
        self._lock = threading.Lock()
        self._compiles = _CompileThreads(COMPILE_THREADS, thread_name_prefix="grammar-compile")
        """This object's own threads (compiles, a large spec's limits): a compile past its deadline holds one of
        these, never a thread of the default executor the decode steps use."""
        self.checker = SpecChecker(limits, shared_pool(processes, timeout, (tokenizer_json, vocab_size, eos_ids)),
                                   field, self._compiles) if isolated else None

    @staticmethod
    def options(config) -> dict:
        """The keyword arguments a worker's config (PrefillConfig, DecodeConfig) sets: its grammar flags."""
        return dict(limits=SpecLimits.of(config), processes=config.grammar_processes, timeout=config.grammar_timeout,
                    cache_bytes=config.grammar_cache_bytes)

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
        """Builds the LLTokenizer in a daemon thread (a second or more for a 150k vocabulary) and starts the
        grammar children, so the first structured request does not wait for them; returns the thread."""
        if self.checker is not None:
            self.checker.pool.start()
        thread = threading.Thread(target=lambda: self.tokenizer, daemon=True, name="grammars-tokenizer")
        thread.start()
        return thread

    def key(self, spec: gen_pb.StructuredOutput) -> str:
        """The cache key: a hash of the spec (its serialized bytes: no native work) and the tokenizer."""
        return hashlib.sha256(self.digest.encode() + b"\0" + spec.SerializeToString(deterministic=True)).hexdigest()

    def compiled(self, spec: gen_pb.StructuredOutput) -> llguidance.LLMatcher:
        """The spec's matcher in its initial state, from the cache or, once a child passed it, compiled now on
        the calling thread (blocking); SpecError naming the field when it cannot be enforced."""
        key = self.key(spec)
        matcher = self._cached(key)
        if matcher is not None:
            return matcher
        if self.checker is not None:
            self.checker.check_sync(spec)
        matcher, grammar = self._compile(spec)
        self._store(key, matcher, grammar)
        return matcher

    def is_cached(self, spec: gen_pb.StructuredOutput) -> bool:
        return self.key(spec) in self._cache

    async def prepare(self, spec: gen_pb.StructuredOutput) -> None:
        """Checks the spec in a child, then compiles it on this object's compile threads, each within
        `timeout`; SpecError if it cannot be enforced (nothing cached then). Counts the cache's hit or miss
        (a compile without prepare counts nothing)."""
        key = self.key(spec)
        if self._cached(key, count=True) is not None:
            return
        if self.checker is not None:
            await self.checker.check(spec)
        work = self._compiles.submit(self._compile, spec)
        try:
            matcher, grammar = await asyncio.wait_for(asyncio.wrap_future(work), self.timeout)
        except TimeoutError as e:
            raise SpecError(f"{self.field}.{kind_of(spec)}: grammar too complex: it did not compile within "
                            f"{self.timeout:g} s") from e
        self._store(key, matcher, grammar)

    def _compile(self, spec: gen_pb.StructuredOutput, where: str | None = None) -> tuple[llguidance.LLMatcher, str]:
        """The spec's grammar text and matcher, compiled on the calling thread; SpecError naming the field."""
        where = where or f"{self.field}.{kind_of(spec)}"
        grammar = grammar_of(spec, self.field, where)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0,
                                       limits=llguidance.LLParserLimits(**LIMITS))
        if matcher.is_error():
            raise SpecError(f"{where}: {one_line(matcher.get_error())}")
        return matcher, grammar

    def _cached(self, key: str, count: bool = False) -> llguidance.LLMatcher | None:
        """The cached matcher (refreshed as the most recently used), or None; `count`: a hit or a miss."""
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
            if count:
                self.hits += entry is not None
                self.misses += entry is None
        if count:
            (metrics.grammar_cache_hits if entry is not None else metrics.grammar_cache_misses).inc()
        return None if entry is None else entry[0]

    def _store(self, key: str, matcher: llguidance.LLMatcher, grammar: str) -> None:
        """Caches a compiled matcher, evicting the least recently used until the cache fits `cache_bytes`
        (a matcher larger than the whole budget is used once, never cached)."""
        size = matcher_bytes(grammar)
        evicted = 0
        with self._lock:
            if key in self._cache or size > self.cache_bytes:
                return
            self._cache[key] = (matcher, size)
            self.cached_bytes += size
            while self.cached_bytes > self.cache_bytes:
                _, (_, freed) = self._cache.popitem(last=False)
                self.cached_bytes -= freed
                evicted += 1
            self.evictions += evicted
            cached = self.cached_bytes
        if evicted:
            metrics.grammar_cache_evictions.inc(evicted)
        metrics.grammar_cache_bytes.set(cached)

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

    def for_request(self, request: pb.PrefillRequest | pb.DecodeRequest) -> Constraint | None:
        """The request's matcher after its outputs so far, for either tier: a prompt ends with the outputs a
        migration (or re-prefill) carries, `sample_index` of a PrefillRequest's `token_ids`, `num_output_tokens`
        of a DecodeRequest's `prompt_token_ids`; ValueError if the spec cannot be enforced over them."""
        if isinstance(request, pb.PrefillRequest):
            tokens, n = request.token_ids, request.sample_index
        else:
            tokens, n = request.prompt_token_ids, request.num_output_tokens
        return self.replayed(request.sampling.structured, list(tokens[len(tokens) - n:]) if n else [])


def request_constraint(grammars: Grammars | None, request: pb.PrefillRequest | pb.DecodeRequest,
                       role: str = "decode") -> Constraint | None:
    """A worker's matcher for the request (`Grammars.for_request`), None without a spec; ValueError naming the
    field when it cannot be enforced, or when this `role` worker has no tokenizer to compile it with."""
    if not request.sampling.structured.WhichOneof("kind"):
        return None
    if grammars is None:
        raise ValueError(f"sampling.structured: this {role} worker has no tokenizer to compile grammars with")
    return grammars.for_request(request)
