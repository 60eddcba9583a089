"""The coordinator process: the public Generation service in front of the worker pools."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health

from pdserve.v1 import generation_pb2, generation_pb2_grpc, worker_pb2_grpc
from pdserve.server.coordinator import kserve
from pdserve.server.coordinator.config import CoordinatorConfig
from pdserve.kvcache.block_hash import BlockHasher
from pdserve.server.coordinator.http_server import HttpServer
from pdserve.server.coordinator.kv_index import KvIndex
from pdserve.server.coordinator.kv_routing import KvRouting
from pdserve.server.coordinator.kv_subscriber import KvSubscriber, sources_of
from pdserve.server.coordinator.openai.app import serve_http
from pdserve.server.coordinator.registry import SERVICE_NAME as REGISTRY_SERVICE
from pdserve.server.coordinator.registry import RegistryService
from pdserve.server.coordinator.router import Router
from pdserve.server.coordinator.service import GenerationService
from pdserve.server.coordinator.validate import Limits
from pdserve.server.coordinator.worker_pool import Worker, WorkerPool
from pdserve.server.coordinator.adapters import Adapters
from pdserve.server.lora_config import parse_lora_modules
from pdserve.server.model.config import ModelConfig, load_config, resolve_max_model_len
from pdserve.server.model.tokenizer import Tokenizer
from pdserve.server import metrics
from pdserve.server.metrics import serve_metrics
from pdserve.server.security import ApiKeyInterceptor
from pdserve.server.serving import cluster_auth, new_server, set_serving, wait_for_signal
from pdserve.server.structured.checker import SpecChecker
from pdserve.server.structured.limits import SpecLimits
from pdserve.server.structured.pool import GrammarPool

log = logging.getLogger("pdserve.coordinator")

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


def spec_checker(config: CoordinatorConfig) -> SpecChecker:
    """The coordinator's grammar child processes (started now) and the spec limits of its flags."""
    pool = GrammarPool(config.grammar_processes, config.grammar_timeout)
    pool.start()
    return SpecChecker(SpecLimits.of(config), pool, field="structured")


def kv_routing(config: CoordinatorConfig, pool: WorkerPool) -> tuple[KvRouting | None, KvSubscriber | None]:
    """The KV index, fed by a subscriber (started now) that follows the pool's workers, and the routing by it;
    (None, None) under --no-kv-events-subscribe."""
    if not config.kv_events_subscribe:
        return None, None
    hasher = BlockHasher(config.prefix_caching_hash_algo)
    index = KvIndex(config.kv_index_max_blocks)
    subscriber = KvSubscriber(index, hasher)
    pool.watchers.append(lambda workers: subscriber.set_sources(sources_of(workers)))
    subscriber.start()
    return KvRouting(index, hasher, config.kv_overlap_score_weight), subscriber


@dataclass
class Coordinator:
    config: CoordinatorConfig
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    pool: WorkerPool
    port: int
    service: GenerationService
    http: HttpServer | None = None
    """The OpenAI-compatible HTTP front, when `http_port` is set."""
    registry_server: grpc.aio.Server | None = None
    """The Registry alone on `registry_port` (an internal port), when set."""
    registry_port: int = 0
    kv_subscriber: KvSubscriber | None = None
    """Reads the workers' KV events into the KV index (--kv-events-subscribe)."""

    async def stop(self, grace: float | None = None) -> None:
        """NOT_SERVING first (load balancers stop sending), then in-flight requests get `grace` seconds."""
        await set_serving(self.health, [SERVICE_NAME], False)
        grace = self.config.grace_seconds if grace is None else grace
        await asyncio.gather(self.server.stop(grace), *([self.http.stop(grace)] if self.http else []),
                             *([self.registry_server.stop(grace)] if self.registry_server else []))
        await self.service.steps.close()
        self.service.checker.pool.close()
        await self.pool.close()
        if self.kv_subscriber is not None:
            await asyncio.to_thread(self.kv_subscriber.close)


def lora_adapters(config: CoordinatorConfig, model: ModelConfig) -> Adapters | None:
    """--enable-lora's adapters, each of --lora-modules checked (a bad one stops the start, naming it, as vLLM's
    init_static_loras does); None without the flag."""
    if not config.enable_lora:
        return None
    adapters = Adapters(model, config.max_lora_rank)
    for module in parse_lora_modules(config.lora_modules):
        adapters.add(module)
    return adapters


async def start(config: CoordinatorConfig) -> Coordinator:
    """Loads the tokenizer and limits, polls the workers once, and starts serving."""
    model = load_config(config.model_dir).limited_to(config.max_model_len)
    tokenizer = Tokenizer.from_dir(config.model_dir)
    # The API key guards generation on both public gRPC APIs (KServe's liveness and metadata stay open).
    guarded = (SERVICE_NAME, f"{kserve.SERVICE_NAME}/ModelInfer", f"{kserve.SERVICE_NAME}/ModelStreamInfer")
    interceptors = [ApiKeyInterceptor(config.api_key, guarded)] if config.api_key else []
    # Reflection lists the public services only; the registry answers cluster members (security.py).
    server, health_servicer, port = new_server([SERVICE_NAME, kserve.SERVICE_NAME], config.port, config.host,
                                               interceptors, reuse_port=config.reuse_port)
    await set_serving(health_servicer, [SERVICE_NAME], False)

    async def on_change(serving: bool) -> None:
        log.info(
            "coordinator is %s",
            "SERVING" if serving else "NOT_SERVING (needs a ready decode worker)",
        )
        await set_serving(health_servicer, [SERVICE_NAME], serving)

    pool = WorkerPool(config.refresh_seconds, on_change, heartbeat_timeout=config.heartbeat_timeout)
    for address in config.prefill_addresses:
        pool.add(Worker(address, "prefill"))
    for address in config.decode_addresses:
        pool.add(Worker(address, "decode"))
    max_model_len = resolve_max_model_len(model.max_model_len, config.max_model_len or 0)
    limits = Limits(max_model_len=max_model_len, vocab_size=model.vocab_size,
                    max_prompt_bytes=config.max_prompt_bytes, max_token_bytes=tokenizer.max_token_bytes())
    metrics.identify(config.model_name, "coordinator", model.max_model_len)  # before the KV subscriber reports
    kv, subscriber = kv_routing(config, pool)
    router = Router(pool, prefill_policy=config.prefill_policy, decode_policy=config.decode_policy,
                    max_queue=config.max_queue, kv=kv)
    service = GenerationService(tokenizer, limits, router, config.lease_seconds,
                                default_timeout=config.default_timeout,
                                max_migrations=config.max_migrations, stall_timeout=config.stall_timeout,
                                ttft_budget=config.ttft_budget, decode_streams=config.decode_streams,
                                max_coalesce=config.max_coalesce, checker=spec_checker(config),
                                conditional_disagg_max_uncached=config.conditional_disagg_max_uncached,
                                conditional_disagg_min_cached=config.conditional_disagg_min_cached,
                                adapters=lora_adapters(config, model))
    generation_pb2_grpc.add_GenerationServicer_to_server(service, server)
    kserve.add_to_server(kserve.KServeService(service, config.model_name, lambda: pool.serving,
                                              max_model_len), server)
    registry = RegistryService(pool, heartbeat_seconds=min(config.refresh_seconds, config.heartbeat_timeout / 3),
                               role_bound=bool(cluster_auth() and cluster_auth().role_bound))
    registry_server, registry_port = None, port
    if config.registry_port is None:
        worker_pb2_grpc.add_RegistryServicer_to_server(registry, server)
    else:  # the public port then serves the public services only
        registry_server, _, registry_port = new_server([REGISTRY_SERVICE], config.registry_port, config.host)
        worker_pb2_grpc.add_RegistryServicer_to_server(registry, registry_server)
    if kv is not None:
        metrics.kv_index_blocks.set_function(kv.index.num_blocks)
    serve_metrics(config.metrics_port, config.host)
    await pool.start()
    await server.start()
    if registry_server is not None:
        await registry_server.start()
    http = None
    if config.http_port is not None:
        http = await serve_http(config, service, lambda: pool.serving, max_model_len)
    return Coordinator(config, server, health_servicer, pool, port, service, http, registry_server, registry_port,
                       subscriber)


async def serve(config: CoordinatorConfig, ready: asyncio.Event | None = None) -> None:
    """Serves until SIGINT or SIGTERM, then drains."""
    coordinator = await start(config)
    log.info("coordinator listening on %s:%d", config.host, coordinator.port)
    if coordinator.registry_server is not None:
        log.info("worker registry on %s:%d (internal)", config.host, coordinator.registry_port)
    if ready is not None:
        ready.set()
    try:
        await wait_for_signal()
    finally:
        await coordinator.stop()
