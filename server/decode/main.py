"""Starts one decode worker process: load the model, open the paged cache, serve."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc

from pdserve.kvcache.block_hash import BlockHasher
from pdserve.kvcache.grpc_receiver import add_receiver_to_server
from pdserve.kvcache.kv_event_publisher import ZmqEventPublisher, open_publisher
from pdserve.kvcache.receiver import KvReceiver
from pdserve.v1 import worker_pb2_grpc
from pdserve.server import metrics, serving
from pdserve.server.malformed import MalformedInterceptor
from pdserve.server.decode.config import DecodeConfig
from pdserve.server.decode.engine_api import Engine
from pdserve.server.decode.lora import adapters_in_flight
from pdserve.server.decode.service import DecodeService
from pdserve.server.decode.startup import build_native_engine
from pdserve.server.kv_events_source import kv_events_source
from pdserve.server.model.fingerprint import fingerprint
from pdserve.server.registration import Memberships, join, serve_until_signal

log = logging.getLogger("pdserve.decode")

SERVICES = ["pdserve.v1.Decode", "pdserve.v1.KvTransfer", "pdserve.v1.Control"]


@dataclass
class DecodeWorker:
    server: object
    service: DecodeService
    engine: Engine
    port: int
    health: object = None
    kv_server: object = None
    """The KvTransfer-only server (`--kv-port`), or None when KvTransfer shares the main port."""
    kv_port: int = 0
    registration: Memberships | None = None
    kv_publisher: ZmqEventPublisher | None = None
    """Publishes the prefix cache's KV events (--kv-events-config), or None."""

    async def drain(self, seconds: float) -> None:
        """No new Decode calls, the coordinator told; in-flight requests finish (up to `seconds`)."""
        self.service.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        await serving.drain(self.health, SERVICES, lambda: bool(self.engine.sequences), seconds,
                            self.registration.beat if self.registration else None)
        # the last tokens may still wait on a slow coordinator's window: end the Steps streams after them
        await self.service.end_streams(max(1.0, deadline - loop.time()))

    async def stop(self, grace: float = 1.0) -> None:
        if self.registration is not None:
            await self.registration.close()
        await self.server.stop(grace)
        if self.kv_server is not None:
            await self.kv_server.stop(grace)
        await self.engine.close()
        if self.kv_publisher is not None:
            self.kv_publisher.close()


def build_engine(config: DecodeConfig, address: str = ""):
    """address: the worker's advertised one (the `{worker}` of --kv-events-config's topic, for vLLM's publisher)."""
    if config.engine == "vllm":
        from pdserve.server.decode.vllm.worker import build_vllm_engine

        return build_vllm_engine(config, address)
    return build_native_engine(config)


def open_kv_publisher(config: DecodeConfig, engine: Engine, address: str) -> ZmqEventPublisher | None:
    """The KV events' publisher, its topic's {worker} this worker's address, set on the engine's recorder."""
    recorder = getattr(engine, "kv_events", None)
    if recorder is None:
        return None
    publisher = open_publisher(config.kv_events, address)
    recorder.publisher = publisher
    if publisher is not None:
        log.info("KV events: publishing on %s (topic %r%s)", publisher.endpoint, publisher.topic.decode(),
                 f", replay on {publisher.replay_endpoint}" if publisher.replay_endpoint else "")
    return publisher


async def start(config: DecodeConfig, options: serving.WorkerOptions = serving.WorkerOptions()) -> DecodeWorker:
    server, health, port = serving.new_server(SERVICES, config.port, config.host)
    address = options.advertise_address or f"{config.host}:{port}"
    model_config, engine, layout = build_engine(config, address)
    digest = fingerprint(config.model_dir, model_config)
    receiver = KvReceiver(layout, digest, engine)
    kv_server, kv_port, kv_address = None, port, ""
    if options.kv_port is not None:  # KvTransfer alone on its own port (a NetworkPolicy opens it to prefill)
        kv_server = grpc.aio.server(options=serving.CHANNEL_OPTIONS,
                                    interceptors=[*serving.server_interceptors(), MalformedInterceptor()])
        kv_port = serving.add_port(kv_server, options.kv_port, config.host)
        kv_address = f"{address.rpartition(':')[0]}:{kv_port}"
        add_receiver_to_server(receiver, kv_server)
    else:
        add_receiver_to_server(receiver, server)
    service = DecodeService(
        engine, receiver, fingerprint=digest, description=model_config.describe(),
        address=address, kv_address=kv_address,
    )
    kv_publisher = open_kv_publisher(config, engine, address)
    if kv_publisher is not None:
        service.kv_events = kv_events_source(kv_publisher, config.kv_events.endpoint, address,
                                             engine.scheduler.cache.hasher, engine.layout.block_size)
    elif getattr(engine, "kv_event_stream", None) is not None:  # vLLM's engine publishes its own (`vllm/worker.py`)
        service.kv_events = kv_events_source(engine.kv_event_stream, config.kv_events.endpoint, address,
                                             BlockHasher(config.prefix_caching_hash_algo), engine.layout.block_size)
    worker_pb2_grpc.add_DecodeServicer_to_server(service, server)
    worker_pb2_grpc.add_ControlServicer_to_server(service, server)
    await server.start()
    if kv_server is not None:
        await kv_server.start()
    await serving.set_serving(health, SERVICES, True)
    metrics.identify(config.model_name, "decode", model_config.max_model_len)
    metrics.watch_kv_blocks(lambda: engine.num_free_blocks, lambda: engine.num_total_blocks)
    metrics.num_requests_running.set_function(lambda: len(engine.running))
    metrics.num_requests_waiting.set_function(lambda: len(engine.sequences) - len(engine.running))
    if getattr(engine, "lora", None) is not None:  # --enable-lora (the vLLM engine serves no adapters yet)
        metrics.watch_lora(engine.lora.max_loras, lambda: adapters_in_flight(engine.running, engine.sequences))
    metrics.serve_metrics(options.metrics_port, config.host)
    log.info("decode worker listening on %s:%d%s", config.host, port,
             f" (KV transfer on port {kv_port})" if kv_server is not None else "")
    worker = DecodeWorker(server, service, engine, port, health, kv_server, kv_port, kv_publisher=kv_publisher)
    if options.coordinator:
        await join(worker, options.coordinator, lambda: service.info())
    return worker


async def serve(config: DecodeConfig, options: serving.WorkerOptions = serving.WorkerOptions()) -> None:
    await serve_until_signal(await start(config, options), "decode", options.drain_seconds)
