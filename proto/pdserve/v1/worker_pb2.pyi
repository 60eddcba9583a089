from pdserve.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvLayout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype", "scale_granularity", "layer_windows", "layout_kind")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SCALE_GRANULARITY_FIELD_NUMBER: _ClassVar[int]
    LAYER_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_KIND_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    scale_granularity: str
    layer_windows: _containers.RepeatedScalarFieldContainer[int]
    layout_kind: str
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., scale_granularity: _Optional[str] = ..., layer_windows: _Optional[_Iterable[int]] = ..., layout_kind: _Optional[str] = ...) -> None: ...

class KvTarget(_message.Message):
    __slots__ = ("address", "layout", "cached_blocks")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    address: str
    layout: KvLayout
    cached_blocks: int
    def __init__(self, address: _Optional[str] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., cached_blocks: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "attempt", "token_ids", "sampling", "target", "transfer_token", "sample_index", "ttft_budget_seconds", "arrived_seconds_ago", "lora")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TTFT_BUDGET_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ARRIVED_SECONDS_AGO_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    attempt: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generation_pb2.SamplingParams
    target: KvTarget
    transfer_token: bytes
    sample_index: int
    ttft_budget_seconds: float
    arrived_seconds_ago: float
    lora: LoraAdapter
    def __init__(self, request_id: _Optional[str] = ..., attempt: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., target: _Optional[_Union[KvTarget, _Mapping]] = ..., transfer_token: _Optional[bytes] = ..., sample_index: _Optional[int] = ..., ttft_budget_seconds: _Optional[float] = ..., arrived_seconds_ago: _Optional[float] = ..., lora: _Optional[_Union[LoraAdapter, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "prefill_seconds", "first_token_logprob", "prompt_logprobs")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    prefill_seconds: float
    first_token_logprob: _generation_pb2.TokenLogprob
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    def __init__(self, first_token_id: _Optional[int] = ..., prefill_seconds: _Optional[float] = ..., first_token_logprob: _Optional[_Union[_generation_pb2.TokenLogprob, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "attempt", "prompt_token_ids", "sampling", "transfer_token", "lease_seconds", "num_output_tokens", "local_prefill", "steps_stream_id", "local_prefill_max_uncached", "local_prefill_min_cached", "lora")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    STEPS_STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_MAX_UNCACHED_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_MIN_CACHED_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    attempt: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generation_pb2.SamplingParams
    transfer_token: bytes
    lease_seconds: float
    num_output_tokens: int
    local_prefill: bool
    steps_stream_id: str
    local_prefill_max_uncached: int
    local_prefill_min_cached: int
    lora: LoraAdapter
    def __init__(self, request_id: _Optional[str] = ..., attempt: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., transfer_token: _Optional[bytes] = ..., lease_seconds: _Optional[float] = ..., num_output_tokens: _Optional[int] = ..., local_prefill: _Optional[bool] = ..., steps_stream_id: _Optional[str] = ..., local_prefill_max_uncached: _Optional[int] = ..., local_prefill_min_cached: _Optional[int] = ..., lora: _Optional[_Union[LoraAdapter, _Mapping]] = ...) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("name", "id", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    id: int
    path: str
    def __init__(self, name: _Optional[str] = ..., id: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class Reserved(_message.Message):
    __slots__ = ("num_blocks", "cached_blocks", "local_prefill")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    cached_blocks: int
    local_prefill: bool
    def __init__(self, num_blocks: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., local_prefill: _Optional[bool] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("token_ids", "logprobs", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("reason", "message", "status")
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    reason: _generation_pb2.FinishReason
    message: str
    status: int
    def __init__(self, reason: _Optional[_Union[_generation_pb2.FinishReason, str]] = ..., message: _Optional[str] = ..., status: _Optional[int] = ...) -> None: ...

class Queued(_message.Message):
    __slots__ = ("position",)
    POSITION_FIELD_NUMBER: _ClassVar[int]
    position: int
    def __init__(self, position: _Optional[int] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("reserved", "tokens", "finished", "queued")
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    reserved: Reserved
    tokens: TokenEvent
    finished: Finished
    queued: Queued
    def __init__(self, reserved: _Optional[_Union[Reserved, _Mapping]] = ..., tokens: _Optional[_Union[TokenEvent, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ..., queued: _Optional[_Union[Queued, _Mapping]] = ...) -> None: ...

class StepsRequest(_message.Message):
    __slots__ = ("stream_id",)
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    def __init__(self, stream_id: _Optional[str] = ...) -> None: ...

class SequenceEvent(_message.Message):
    __slots__ = ("request_id", "tokens", "finished", "queued")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tokens: TokenEvent
    finished: Finished
    queued: Queued
    def __init__(self, request_id: _Optional[str] = ..., tokens: _Optional[_Union[TokenEvent, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ..., queued: _Optional[_Union[Queued, _Mapping]] = ...) -> None: ...

class StepBatch(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[SequenceEvent]
    def __init__(self, events: _Optional[_Iterable[_Union[SequenceEvent, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class ModelFingerprint(_message.Message):
    __slots__ = ("digest", "description")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    digest: str
    description: str
    def __init__(self, digest: _Optional[str] = ..., description: _Optional[str] = ...) -> None: ...

class KvHeader(_message.Message):
    __slots__ = ("request_id", "attempt", "transfer_token", "fingerprint", "layout", "num_tokens", "protocol_version", "stream_index", "num_streams", "cached_blocks", "lora_name")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    STREAM_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_STREAMS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    attempt: int
    transfer_token: bytes
    fingerprint: ModelFingerprint
    layout: KvLayout
    num_tokens: int
    protocol_version: int
    stream_index: int
    num_streams: int
    cached_blocks: int
    lora_name: str
    def __init__(self, request_id: _Optional[str] = ..., attempt: _Optional[int] = ..., transfer_token: _Optional[bytes] = ..., fingerprint: _Optional[_Union[ModelFingerprint, _Mapping]] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., num_tokens: _Optional[int] = ..., protocol_version: _Optional[int] = ..., stream_index: _Optional[int] = ..., num_streams: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., lora_name: _Optional[str] = ...) -> None: ...

class KvBlocks(_message.Message):
    __slots__ = ("layer_start", "layer_count", "token_start", "token_count", "k", "v", "k_scales", "v_scales")
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_COUNT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    V_FIELD_NUMBER: _ClassVar[int]
    K_SCALES_FIELD_NUMBER: _ClassVar[int]
    V_SCALES_FIELD_NUMBER: _ClassVar[int]
    layer_start: int
    layer_count: int
    token_start: int
    token_count: int
    k: bytes
    v: bytes
    k_scales: bytes
    v_scales: bytes
    def __init__(self, layer_start: _Optional[int] = ..., layer_count: _Optional[int] = ..., token_start: _Optional[int] = ..., token_count: _Optional[int] = ..., k: _Optional[bytes] = ..., v: _Optional[bytes] = ..., k_scales: _Optional[bytes] = ..., v_scales: _Optional[bytes] = ...) -> None: ...

class KvEnd(_message.Message):
    __slots__ = ("first_token_id",)
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    def __init__(self, first_token_id: _Optional[int] = ...) -> None: ...

class KvAbort(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class KvChunk(_message.Message):
    __slots__ = ("header", "blocks", "end", "abort")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    header: KvHeader
    blocks: KvBlocks
    end: KvEnd
    abort: KvAbort
    def __init__(self, header: _Optional[_Union[KvHeader, _Mapping]] = ..., blocks: _Optional[_Union[KvBlocks, _Mapping]] = ..., end: _Optional[_Union[KvEnd, _Mapping]] = ..., abort: _Optional[_Union[KvAbort, _Mapping]] = ...) -> None: ...

class BeginKvResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PushKvResponse(_message.Message):
    __slots__ = ("tokens_received", "bytes_received")
    TOKENS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    tokens_received: int
    bytes_received: int
    def __init__(self, tokens_received: _Optional[int] = ..., bytes_received: _Optional[int] = ...) -> None: ...

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("queued_prefill_tokens", "running_requests", "waiting_requests", "free_kv_blocks", "total_kv_blocks", "max_running_requests", "prefill_buckets", "max_waiting_requests", "cached_kv_blocks", "device_loras", "host_loras")
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FREE_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_BUCKETS_FIELD_NUMBER: _ClassVar[int]
    MAX_WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    CACHED_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_LORAS_FIELD_NUMBER: _ClassVar[int]
    HOST_LORAS_FIELD_NUMBER: _ClassVar[int]
    queued_prefill_tokens: int
    running_requests: int
    waiting_requests: int
    free_kv_blocks: int
    total_kv_blocks: int
    max_running_requests: int
    prefill_buckets: _containers.RepeatedCompositeFieldContainer[PrefillBucket]
    max_waiting_requests: int
    cached_kv_blocks: int
    device_loras: _containers.RepeatedCompositeFieldContainer[LoraAdapter]
    host_loras: _containers.RepeatedCompositeFieldContainer[LoraAdapter]
    def __init__(self, queued_prefill_tokens: _Optional[int] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., free_kv_blocks: _Optional[int] = ..., total_kv_blocks: _Optional[int] = ..., max_running_requests: _Optional[int] = ..., prefill_buckets: _Optional[_Iterable[_Union[PrefillBucket, _Mapping]]] = ..., max_waiting_requests: _Optional[int] = ..., cached_kv_blocks: _Optional[int] = ..., device_loras: _Optional[_Iterable[_Union[LoraAdapter, _Mapping]]] = ..., host_loras: _Optional[_Iterable[_Union[LoraAdapter, _Mapping]]] = ...) -> None: ...

class PrefillBucket(_message.Message):
    __slots__ = ("max_tokens", "queued_tokens", "queued_prompts", "tokens_per_second", "expected_wait_seconds")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PROMPTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    queued_tokens: int
    queued_prompts: int
    tokens_per_second: float
    expected_wait_seconds: float
    def __init__(self, max_tokens: _Optional[int] = ..., queued_tokens: _Optional[int] = ..., queued_prompts: _Optional[int] = ..., tokens_per_second: _Optional[float] = ..., expected_wait_seconds: _Optional[float] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("role", "address", "fingerprint", "kv_layout", "load", "max_model_len", "draining", "kv_address", "prefill_order", "prefill_deadlines", "hardware", "kv_events")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ORDER_FIELD_NUMBER: _ClassVar[int]
    PREFILL_DEADLINES_FIELD_NUMBER: _ClassVar[int]
    HARDWARE_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    role: str
    address: str
    fingerprint: ModelFingerprint
    kv_layout: KvLayout
    load: WorkerLoad
    max_model_len: int
    draining: bool
    kv_address: str
    prefill_order: str
    prefill_deadlines: bool
    hardware: Hardware
    kv_events: KvEventsSource
    def __init__(self, role: _Optional[str] = ..., address: _Optional[str] = ..., fingerprint: _Optional[_Union[ModelFingerprint, _Mapping]] = ..., kv_layout: _Optional[_Union[KvLayout, _Mapping]] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ..., max_model_len: _Optional[int] = ..., draining: _Optional[bool] = ..., kv_address: _Optional[str] = ..., prefill_order: _Optional[str] = ..., prefill_deadlines: _Optional[bool] = ..., hardware: _Optional[_Union[Hardware, _Mapping]] = ..., kv_events: _Optional[_Union[KvEventsSource, _Mapping]] = ...) -> None: ...

class KvEventsSource(_message.Message):
    __slots__ = ("endpoint", "replay_endpoint", "topic", "hash_algo", "block_size", "probe_hash", "epoch")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    REPLAY_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    HASH_ALGO_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROBE_HASH_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    endpoint: str
    replay_endpoint: str
    topic: str
    hash_algo: str
    block_size: int
    probe_hash: int
    epoch: int
    def __init__(self, endpoint: _Optional[str] = ..., replay_endpoint: _Optional[str] = ..., topic: _Optional[str] = ..., hash_algo: _Optional[str] = ..., block_size: _Optional[int] = ..., probe_hash: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class Hardware(_message.Message):
    __slots__ = ("cpu_model", "cpu_family", "cpu_features", "cpu_cap", "framework", "devices", "paths", "summary")
    class PathsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CPU_MODEL_FIELD_NUMBER: _ClassVar[int]
    CPU_FAMILY_FIELD_NUMBER: _ClassVar[int]
    CPU_FEATURES_FIELD_NUMBER: _ClassVar[int]
    CPU_CAP_FIELD_NUMBER: _ClassVar[int]
    FRAMEWORK_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    PATHS_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    cpu_model: str
    cpu_family: str
    cpu_features: _containers.RepeatedScalarFieldContainer[str]
    cpu_cap: str
    framework: str
    devices: str
    paths: _containers.ScalarMap[str, str]
    summary: str
    def __init__(self, cpu_model: _Optional[str] = ..., cpu_family: _Optional[str] = ..., cpu_features: _Optional[_Iterable[str]] = ..., cpu_cap: _Optional[str] = ..., framework: _Optional[str] = ..., devices: _Optional[str] = ..., paths: _Optional[_Mapping[str, str]] = ..., summary: _Optional[str] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: WorkerInfo
    def __init__(self, info: _Optional[_Union[WorkerInfo, _Mapping]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("heartbeat_seconds",)
    HEARTBEAT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    heartbeat_seconds: float
    def __init__(self, heartbeat_seconds: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: WorkerInfo
    def __init__(self, info: _Optional[_Union[WorkerInfo, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("info", "state", "registered", "seconds_since_seen", "inflight", "role", "address")
    INFO_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_SEEN_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    info: WorkerInfo
    state: str
    registered: bool
    seconds_since_seen: float
    inflight: int
    role: str
    address: str
    def __init__(self, info: _Optional[_Union[WorkerInfo, _Mapping]] = ..., state: _Optional[str] = ..., registered: _Optional[bool] = ..., seconds_since_seen: _Optional[float] = ..., inflight: _Optional[int] = ..., role: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ...) -> None: ...
