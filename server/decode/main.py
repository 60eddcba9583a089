"""Starts one decode worker process: load the model, open the paged cache, serve."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc
import torch

from pdserve.kvcache.layout import QUANTIZED, KvLayout
from pdserve.kvcache.receiver import KvReceiver, add_receiver_to_server
from pdserve.v1 import worker_pb2_grpc
from pdserve.server import metrics, serving
from pdserve.server.decode.config import DecodeConfig
from pdserve.server.decode.engine import DecodeEngine
from pdserve.server.decode.kv_cache import TORCH_DTYPES
from pdserve.server.decode.model import DecoderModel
from pdserve.server.decode.quant import QUANTIZED_WEIGHTS, buffer_bytes
from pdserve.server.decode.service import DecodeService
from pdserve.server.model.config import load_config
from pdserve.server.model.fingerprint import fingerprint
from pdserve.server.model.weights import load_weights
from pdserve.server.registration import Memberships, join, serve_until_signal

log = logging.getLogger("pdserve.decode")

SERVICES = ["pdserve.v1.Decode", "pdserve.v1.KvTransfer", "pdserve.v1.Control"]


@dataclass
class DecodeWorker:
    server: object
    service: DecodeService
    engine: DecodeEngine
    port: int
    health: object = None
    kv_server: object = None
    """The KvTransfer-only server (`--kv-port`), or None when KvTransfer shares the main port."""
    kv_port: int = 0
    registration: Memberships | None = None

    async def drain(self, seconds: float) -> None:
        """No new Decode calls, the coordinator told; in-flight requests finish (up to `seconds`)."""
        self.service.draining = True
        await serving.drain(self.health, SERVICES, lambda: bool(self.engine.sequences), seconds,
                            self.registration.beat if self.registration else None)

    async def stop(self, grace: float = 1.0) -> None:
        if self.registration is not None:
            await self.registration.close()
        await self.server.stop(grace)
        if self.kv_server is not None:
            await self.kv_server.stop(grace)
        await self.engine.close()


def build_engine(config: DecodeConfig):
    if config.engine == "vllm":
        from pdserve.server.decode.vllm_worker import build_vllm_engine

        return build_vllm_engine(config)
    model_config = load_config(config.model_dir).limited_to(config.max_model_len)
    if config.gpu_memory_utilization is not None:
        log.warning("--gpu-memory-utilization %s does not apply: this decode worker computes on the CPU; its KV "
                    "cache holds --kv-cache-tokens %d tokens", config.gpu_memory_utilization, config.kv_cache_tokens)
    weight_dtype = model_config.dtype if config.weight_dtype == "auto" else config.weight_dtype
    quantized = weight_dtype in QUANTIZED_WEIGHTS
    compute_dtype = (model_config.dtype if model_config.dtype in TORCH_DTYPES else "float32") if quantized \
        else weight_dtype
    kv_dtype = compute_dtype if config.kv_dtype == "auto" else config.kv_dtype
    if config.threads:
        torch.set_num_threads(config.threads)
    t0 = time.perf_counter()
    model = DecoderModel(model_config, load_weights(config.model_dir), dtype=TORCH_DTYPES[compute_dtype],
                         weight_format=weight_dtype if quantized else None)
    layout = KvLayout(
        num_layers=model_config.num_layers,
        num_kv_heads=model_config.num_kv_heads,
        head_dim=model_config.head_dim,
        block_size=config.block_size,
        dtype=kv_dtype,
        scale_granularity="block_head" if kv_dtype in QUANTIZED else "none",
    )
    engine = DecodeEngine(model, layout, config.num_blocks, config.max_running, max_queue=config.max_queue,
                          enable_prefix_caching=config.enable_prefix_caching,
                          eos_ids=frozenset(model_config.eos_token_ids), max_model_len=config.max_model_len or 0)
    log.info("decode model %s loaded in %.1f s; weights %.1f MiB (%s, compute %s); KV cache %d blocks x %d "
             "tokens (%s, %.1f MiB incl. scales)", model_config.describe(), time.perf_counter() - t0,
             buffer_bytes(model) / 2**20, weight_dtype, compute_dtype, config.num_blocks, config.block_size,
             kv_dtype, engine.cache.nbytes / 2**20)
    return model_config, engine, layout


async def start(config: DecodeConfig, options: serving.WorkerOptions = serving.WorkerOptions()) -> DecodeWorker:
    model_config, engine, layout = build_engine(config)
    digest = fingerprint(config.model_dir, model_config)
    receiver = KvReceiver(layout, digest, engine)
    server, health, port = serving.new_server(SERVICES, config.port, config.host)
    address = options.advertise_address or f"{config.host}:{port}"
    kv_server, kv_port, kv_address = None, port, ""
    if options.kv_port is not None:  # KvTransfer alone on its own port (a NetworkPolicy opens it to prefill)
        kv_server = grpc.aio.server(options=serving.CHANNEL_OPTIONS, interceptors=serving.server_interceptors() or None)
        kv_port = serving.add_port(kv_server, options.kv_port, config.host)
        kv_address = f"{address.rpartition(':')[0]}:{kv_port}"
        add_receiver_to_server(receiver, kv_server)
    else:
        add_receiver_to_server(receiver, server)
    service = DecodeService(
        engine, receiver, fingerprint=digest, description=model_config.describe(),
        address=address, kv_address=kv_address,
    )
    worker_pb2_grpc.add_DecodeServicer_to_server(service, server)
    worker_pb2_grpc.add_ControlServicer_to_server(service, server)
    await server.start()
    if kv_server is not None:
        await kv_server.start()
    await serving.set_serving(health, SERVICES, True)
    metrics.identify(config.model_name, "decode", model_config.max_model_len)
    metrics.watch_kv_blocks(lambda: engine.num_free_blocks, lambda: engine.pool.num_total)
    metrics.num_requests_running.set_function(lambda: len(engine.running))
    metrics.num_requests_waiting.set_function(lambda: len(engine.sequences) - len(engine.running))
    metrics.serve_metrics(options.metrics_port, config.host)
    log.info("decode worker listening on %s:%d%s", config.host, port,
             f" (KV transfer on port {kv_port})" if kv_server is not None else "")
    worker = DecodeWorker(server, service, engine, port, health, kv_server, kv_port)
    if options.coordinator:
        await join(worker, options.coordinator, lambda: service.info())
    return worker


async def serve(config: DecodeConfig, options: serving.WorkerOptions = serving.WorkerOptions()) -> None:
    await serve_until_signal(await start(config, options), "decode", options.drain_seconds)
