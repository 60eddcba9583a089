"""The prefill's compiled programs kept on disk, keyed without tracing, so a restart loads them instead of tracing
and lowering the model again (`--executable-cache`).

JAX's persistent compilation cache saves the XLA compile, but its key is a hash of the lowered program: every start
still traces each program's Python (the model, attention, sampling) and lowers it to StableHLO before it can look
the compile up, ~85 ms of CPU per program on the tiny llama (55 start-up programs, ~4.5 CPU-s; a large model on a
TPU slice traces for minutes). Here a program's key is what its trace depends on, known before tracing:

1. `ExecutableCache.environment`: this cache's format, a digest of pdserve's Python sources (the traced code and
   everything it reads: any edit misses), jax and jaxlib versions, the backend, its version and devices, the
   CPU's features on the CPU backend (XLA:CPU compiles for them), $XLA_FLAGS / $LIBTPU_INIT_ARGS and JAX's
   configuration (everything but its caching and logging options).
2. `Program`'s own: its name, what the engine bound into it (the model's config, the matmul path), the static
   arguments, and each argument's shape, dtype, weak type and sharding with the arguments' tree (weights,
   quantized or not, LoRA stacks: all are arguments).

Any input that differs gives another key: a miss never serves another program's executable. A miss traces,
lowers and compiles as before (JAX's persistent cache still finds the compile) and writes the executable
(`jax.experimental.serialize_executable`, zlib-compressed) under the key, atomically; entries of older
sources stay until the directory is cleared. An entry that cannot be read or loaded is
logged, removed and compiled again. Programs that cannot be serialized (host callbacks) stay in memory only, and
the engine turns the cache off where its programs call host code (`--prefill-matmul onednn-bf16`) and on
slices of several processes. Counts of hits, misses and failures are logged at start (main.py).

An entry is code the worker runs, like JAX's own cache entries: the directory must be writable only by whom
the worker trusts (it lives in --compilation-cache's directory).

XLA:CPU (jaxlib 0.10) re-serializes an executable that JAX's persistent cache loaded without its functions (the
copy fails at run time: "Function ... not found"), so an entry is written only when what JAX reported on the
compiling thread says where the executable came from (`_Origin`): compiled by XLA, serialized as it is; loaded
from the persistent cache, written from that cache's own bytes of it (`_persistent_bytes`). Otherwise (JAX's
in-process caches held it, or those bytes are gone) it serves but is not written ("not stored" in the start-up
log), and the next start misses again: as correct as without this cache.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import pickle
import threading
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from jax.experimental import serialize_executable

log = logging.getLogger("pdserve.prefill")

FORMAT = 3
"""Changes when an entry's layout does: older entries then miss."""

_PACKAGE = Path(__file__).parents[2]
"""The pdserve package's folder: every Python source of its server/ and kvcache/ goes into the key."""


class ExecutableCache:
    def __init__(self, directory: Path, environment: str | None = None):
        """directory: where entries live (made on the first write); environment: the key's shared part
        (`environment_key()` when None)."""
        self.directory = directory
        self.environment = environment_key() if environment is None else environment
        self.hits = self.misses = self.failures = self.unstored = self.copied = 0
        """Programs loaded, compiled (and stored), entries that could not be loaded, programs compiled but not
        stored (not serializable), entries written from JAX's persistent cache's bytes (its hits)."""
        self._lock = threading.Lock()

    def key(self, name: str, bound: str, args: tuple, static: dict[str, Any]) -> str:
        """The entry's name for program `name` (with `bound` bound into it) called on `args` and `static`."""
        leaves, tree = jax.tree.flatten(args)
        parts = [self.environment, name, bound, repr(sorted(static.items())), repr(tree),
                 *(_aval(leaf) for leaf in leaves)]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()

    def load(self, key: str) -> jax.stages.Compiled | None:
        """The executable stored under `key`, loaded onto this process's devices; None: none, or it could not
        be loaded (logged and removed, so the caller compiles it again)."""
        path = self.directory / f"{key}.exe"
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self._count("misses")
            return None
        except OSError as e:
            log.warning("prefill executable cache: cannot read %s (%s); compiling the program again", path, e)
            self._count("failures")
            return None
        try:
            blob, in_tree, out_tree = pickle.loads(zlib.decompress(data))
            compiled = serialize_executable.deserialize_and_load(blob, in_tree, out_tree)
        except Exception as e:  # a truncated or foreign file, a jaxlib that cannot load it
            log.warning("prefill executable cache: %s does not load (%s: %s); removed, compiling the program again",
                        path, type(e).__name__, e)
            path.unlink(missing_ok=True)
            self._count("failures")
            return None
        self._count("hits")
        return compiled

    def store(self, key: str, compiled: jax.stages.Compiled, origin: str | None) -> None:
        """Writes `compiled` under `key`. origin: "compiled" (by XLA in this call), the key of JAX's persistent
        cache entry it was loaded from, or None: unknown (JAX's in-process caches held it), not written."""
        try:
            if origin is None:
                raise ValueError("JAX's in-process caches held it: its bytes are not known")
            if _device(compiled) is None:
                raise ValueError("it runs over several devices (see _fits)")
            persistent_key = None if origin == "compiled" else origin
            blob = _serialize(compiled, persistent_key)
        except Exception as e:  # host callbacks, or a persistent cache entry gone meanwhile
            log.debug("prefill executable cache: %s not stored: %s", key, e)
            self._count("unstored")
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = self.directory / f".{key}.{os.getpid()}.{threading.get_ident()}.tmp"
            tmp.write_bytes(zlib.compress(pickle.dumps((blob, *_trees(compiled))), 1))  # 3.5x smaller
            os.replace(tmp, self.directory / f"{key}.exe")
            if persistent_key is not None:
                self._count("copied")
        except OSError as e:
            log.warning("prefill executable cache: cannot write in %s (%s); the next start compiles again",
                        self.directory, e)
            self._count("unstored")

    def discard(self, key: str) -> None:
        """Removes an entry that loaded but does not fit its call (counted as a failure)."""
        (self.directory / f"{key}.exe").unlink(missing_ok=True)
        self._count("failures")

    def summary(self) -> str:
        """What the log line says: hits, misses, failures, in the directory."""
        return (f"{self.hits} loaded, {self.misses} compiled" + (f", {self.failures} unreadable" if self.failures
                else "") + (f", {self.unstored} not stored" if self.unstored else "") + f" ({self.directory})")

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)


class Program:
    """One jitted function and its executables by argument shapes: `compile` loads (or compiles and stores) the
    executable of a call, `__call__` runs the executable compiled for its arguments, else the jitted function."""

    def __init__(self, name: str, jitted: Callable, bound: str = "", cache: ExecutableCache | None = None):
        self.name, self.jitted, self.bound, self.cache = name, jitted, bound, cache
        self._compiled: dict[tuple, jax.stages.Compiled] = {}
        self._compiling: dict[tuple, threading.Lock] = {}
        """One lock per call key: two threads asking for the same executable load (or compile) it once."""
        self._lock = threading.Lock()

    def compile(self, *args, **static) -> jax.stages.Compiled:
        """The executable for arguments like `args` (arrays or jax.ShapeDtypeStruct) and the static `static`."""
        if self.cache is None:
            return self.jitted.lower(*args, **static).compile()
        call = _call_key(args, static)
        with self._lock:
            lock = self._compiling.setdefault(call, threading.Lock())
        with lock:
            if (compiled := self._compiled.get(call)) is not None:
                return compiled  # another step shape's program of the same arguments (the head's, the embedding's)
            key = self.cache.key(self.name, self.bound, args, static)
            compiled = self.cache.load(key)
            if compiled is not None and not _fits(compiled, args):
                log.warning("prefill executable cache: %s was compiled for other devices than %s's arguments; "
                            "compiling the program again", key, self.name)
                self.cache.discard(key)
                compiled = None
            if compiled is None:
                with _compile_origin() as seen:
                    compiled = self.jitted.lower(*args, **static).compile()
                self.cache.store(key, compiled, seen.origin)
            self._compiled[call] = compiled
            return compiled

    def __call__(self, *args, **static):
        compiled = self._compiled.get(_call_key(args, static)) if self._compiled else None
        return self.jitted(*args, **static) if compiled is None else compiled(*args)


def environment_key() -> str:
    """The part of every key that is this process's, not the program's (1. in the module's docstring)."""
    import jaxlib

    backend = jax.devices()[0].client
    sources = hashlib.sha256()
    for path in _sources():
        sources.update(str(path.relative_to(_PACKAGE)).encode() + b"\0" + path.read_bytes() + b"\0")
    config = sorted((name, repr(value)) for name, value in jax.config.values.items()
                    if not any(word in name for word in ("cache", "log", "debug", "traceback", "profil")))
    parts = [f"format {FORMAT}", sources.hexdigest(), jax.__version__, jaxlib.__version__, backend.platform,
             backend.platform_version, repr([(d.id, d.device_kind, d.process_index) for d in jax.devices()]),
             _cpu_features() if backend.platform == "cpu" else "",
             os.environ.get("XLA_FLAGS", ""), os.environ.get("LIBTPU_INIT_ARGS", ""), repr(config)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _sources() -> list[Path]:
    """pdserve's Python sources (a development checkout links its folders into the package: followed)."""
    found = []
    for top in ("server", "kvcache"):
        for folder, _, names in os.walk(_PACKAGE / top, followlinks=True):
            found += [Path(folder) / name for name in names if name.endswith(".py")]
    return sorted(found)


def _aval(leaf) -> str:
    """An argument as its program sees it: shape, dtype, weak type, sharding (None: uncommitted)."""
    sharding = getattr(leaf, "sharding", None)
    where = None if sharding is None else (repr(sharding), sorted(d.id for d in sharding.device_set))
    weak = getattr(leaf, "weak_type", False)
    return f"{tuple(leaf.shape)} {leaf.dtype} {weak} {where}"


def _device(compiled: jax.stages.Compiled) -> int | None:
    """The id of the one device an executable runs on; None when it runs over several (or cannot say)."""
    try:
        devices = compiled.runtime_executable().local_devices()
    except Exception:  # noqa: BLE001 - an executable that cannot say: not trusted
        return None
    return devices[0].id if len(devices) == 1 else None


def _fits(compiled: jax.stages.Compiled, args: tuple) -> bool:
    """Whether an executable runs on one device, the one the call's committed arguments are on. An executable over
    several devices, loaded back, refused the engine's host arrays at run time ("Expected args to
    execute_sharded_on_local_devices to have 2 shards", jaxlib 0.10.2), where the freshly compiled one places
    them itself: such programs are neither stored nor loaded."""
    device = _device(compiled)
    if device is None:
        return False
    want = {d.id for leaf in jax.tree.leaves(args) if (sharding := getattr(leaf, "sharding", None)) is not None
            for d in sharding.device_set}
    return not want or want == {device}


def _call_key(args: tuple, static: dict[str, Any]) -> tuple:
    """How a call finds its executable in memory: the arguments' tree, shapes and dtypes, and the statics
    (the shardings are the engine's, the same at compile and at each call)."""
    leaves, tree = jax.tree.flatten(args)
    return tree, tuple((tuple(x.shape), x.dtype) for x in leaves), tuple(sorted(static.items()))


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        import platform

        return platform.processor()


def _trees(compiled: jax.stages.Compiled) -> tuple:
    """(in_tree, out_tree) as `deserialize_and_load` takes them back."""
    return jax.tree.structure(compiled.args_info), compiled.out_tree


def _serialize(compiled: jax.stages.Compiled, persistent_key: str | None) -> bytes:
    """`serialize_executable.serialize`'s bytes; after a persistent cache hit, with that cache's bytes of the
    executable in place of its re-serialization (the module's docstring)."""
    if persistent_key is None:
        return serialize_executable.serialize(compiled)[0]
    from jax._src.lib import xla_client

    executable = _persistent_bytes(persistent_key)

    class Pickler(serialize_executable._JaxPjrtPickler):
        def persistent_id(self, obj):
            if isinstance(obj, xla_client.LoadedExecutable):
                return "exec", executable
            return super().persistent_id(obj)

    unloaded = compiled._executable._unloaded_executable
    if unloaded is None or compiled._params.const_args:
        raise ValueError("the executable does not serialize")
    with io.BytesIO() as out:
        Pickler(out).dump((unloaded, jax.tree.leaves(compiled.args_info), compiled._no_kwargs))
        return out.getvalue()


def _persistent_bytes(persistent_key: str) -> bytes:
    """The serialized executable JAX's persistent cache holds under `persistent_key`."""
    from jax._src import compilation_cache

    cache = compilation_cache._get_cache(jax.devices()[0].client)
    entry = None if cache is None else cache.get(persistent_key)
    if entry is None:
        raise ValueError(f"JAX's persistent cache no longer holds {persistent_key}")
    executable, _ = compilation_cache.extract_executable_and_time(compilation_cache.decompress_executable(entry))
    return executable


class _Origin(logging.Filter):
    """Where the executables compiled on a thread came from, from what JAX reports on that thread: XLA's every
    compile or persistent cache load (`jax.monitoring` duration BACKEND_COMPILE), the persistent cache consulted
    (CONSULTED), its hit (HIT_EVENT, and the log line HIT with the key at DEBUG: this filter notes it and lets
    through to the handlers only what the logger passed before), a fresh compile written to it (WRITTEN). No
    report at all: JAX's in-process caches held the executable, whatever its origin."""

    HIT = "Persistent compilation cache hit for"
    BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
    CONSULTED = "/jax/compilation_cache/compile_requests_use_cache"
    HIT_EVENT = "/jax/compilation_cache/cache_hits"
    WRITTEN = "/jax/compilation_cache/cache_misses"

    def __init__(self, level: int):
        super().__init__()
        self.level = level
        self.local = threading.local()
        jax.monitoring.register_event_duration_secs_listener(self._on_event)
        jax.monitoring.register_event_listener(self._on_event)

    def filter(self, record: logging.LogRecord) -> bool:
        seen = getattr(self.local, "seen", None)
        if seen is not None and isinstance(record.msg, str) and record.msg.startswith(self.HIT) and record.args:
            seen.hits.append(record.args[-1])
        return record.levelno >= self.level

    def _on_event(self, event: str, *args, **kwargs) -> None:
        seen = getattr(self.local, "seen", None)
        if seen is not None:
            seen.events.append(event)


class _Seen:
    def __init__(self) -> None:
        self.hits: list[str] = []
        self.events: list[str] = []

    @property
    def origin(self) -> str | None:
        """"compiled" (by XLA, here), the persistent cache's key it was loaded under, or None: not known for
        sure (no report, or reports that do not add up), and so not written."""
        backend, hit = self.events.count(_Origin.BACKEND_COMPILE), self.events.count(_Origin.HIT_EVENT)
        if backend != 1:
            return None
        if hit == 1 and len(self.hits) == 1:
            return self.hits[0]
        if not hit and not self.hits and (_Origin.CONSULTED not in self.events or _Origin.WRITTEN in self.events):
            return "compiled"  # with no persistent cache, or a miss that XLA compiled and JAX wrote
        return None


_compiler_log = logging.getLogger("jax._src.compiler")
_origin: _Origin | None = None
_origin_lock = threading.Lock()


class _compile_origin:
    """`with _compile_origin() as seen:` where the executable compiled on this thread meanwhile came from."""

    def __enter__(self) -> _Seen:
        global _origin
        with _origin_lock:
            if _origin is None:
                _origin = _Origin(_compiler_log.getEffectiveLevel())
                _compiler_log.addFilter(_origin)
                _compiler_log.setLevel(min(logging.DEBUG, _compiler_log.getEffectiveLevel()))
        self.seen = _origin.local.seen = _Seen()
        return self.seen

    def __exit__(self, *exc) -> None:
        assert _origin is not None
        _origin.local.seen = None
