"""KvEventsConfig: `--kv-events-config`, vLLM 0.32's `KVEventsConfig` keys and defaults, as a JSON object.

`{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": null,
"buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000, "topic": ""}`; `publisher` defaults to "zmq"
when events are enabled, else "null".

Telling workers apart: every worker publishes as data-parallel rank 0 of its own stream, and a `{worker}` in
the topic is replaced by the worker's advertised address (host:port), so `"topic": "kv@{worker}@Qwen3-0.6B"`
names each pod as llm-d's indexer expects (`kv@<pod>@<model>`). Several workers of one host that bind
(`tcp://*:PORT`) need a port each: `pdserve up` offsets the endpoints' ports by the worker's index as vLLM offsets
them by data-parallel rank (`for_worker`); workers that connect to one subscriber's bound socket share its
endpoint.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace

FIELDS = ("enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "buffer_steps", "hwm",
          "max_queue_size", "topic")
WORKER_PLACEHOLDER = "{worker}"


@dataclass(frozen=True)
class KvEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher", "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: publisher must be \"zmq\" or \"null\", not {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"--kv-events-config: {name} must be >= 0, got {getattr(self, name)}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"--kv-events-config: {name} must be a zmq endpoint (tcp://HOST:PORT, "
                                 f"tcp://*:PORT to bind, ipc://PATH), not {value!r}")

    @property
    def enabled(self) -> bool:
        """Events are recorded and published (a "null" publisher records nothing)."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def for_worker(self, index: int) -> KvEventsConfig:
        """The config of a launcher's index-th worker: the endpoints it binds (the replay endpoint, and the PUB
        endpoint when it binds) get their own: tcp ports offset by index (a port of 0 left to the OS), ipc/inproc
        ones suffixed, as vLLM's `offset_endpoint_port` does for data-parallel ranks. A connecting endpoint (a
        subscriber's bound socket) is every worker's."""
        endpoint = offset_endpoint(self.endpoint, index) if is_bind_endpoint(self.endpoint) else self.endpoint
        return replace(self, endpoint=endpoint, replay_endpoint=offset_endpoint(self.replay_endpoint, index))

    def topic_for(self, worker: str) -> str:
        return self.topic.replace(WORKER_PLACEHOLDER, worker)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard and ipc/inproc endpoints; connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def offset_endpoint(endpoint: str | None, index: int) -> str | None:
    if not endpoint or index == 0:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{index}"
    base, _, port = endpoint.rpartition(":")
    return endpoint if int(port) == 0 else f"{base}:{int(port) + index}"


def parse_kv_events_config(text: str | None) -> KvEventsConfig | None:
    """The config of `--kv-events-config` (None when not given), refusing keys vLLM 0.32 does not have."""
    if text is None:
        return None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--kv-events-config must be a JSON object, e.g. '{{\"enable_kv_cache_events\": true, "
                         f"\"topic\": \"kv@{{worker}}\"}}': {e}") from None
    if not isinstance(raw, dict):
        raise TypeError(f"--kv-events-config must be a JSON object, not {type(raw).__name__}")
    unknown = sorted(set(raw) - set(FIELDS))
    if unknown:
        raise ValueError(f"--kv-events-config: unknown key(s) {', '.join(unknown)}; vLLM's keys are "
                         f"{', '.join(FIELDS)}")
    return KvEventsConfig(**raw)
