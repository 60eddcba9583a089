"""Starts one decode worker process: load the model, open the paged cache, serve."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import torch

from kvcache.layout import KvLayout
from kvcache.receiver import KvReceiver
from pdserve.v1 import worker_pb2_grpc
from server import serving
from server.decode.config import DecodeConfig
from server.decode.engine import DecodeEngine
from server.decode.kv_cache import TORCH_DTYPES
from server.decode.model import DecoderModel
from server.decode.service import DecodeService
from server.model.config import load_config
from server.model.fingerprint import fingerprint
from server.model.weights import load_weights

log = logging.getLogger("pdserve.decode")

SERVICES = ["pdserve.v1.Decode", "pdserve.v1.KvTransfer", "pdserve.v1.Control"]


@dataclass
class DecodeWorker:
    server: object
    service: DecodeService
    engine: DecodeEngine
    port: int

    async def stop(self, grace: float = 1.0) -> None:
        await self.server.stop(grace)
        await self.engine.close()


def build_engine(config: DecodeConfig):
    model_config = load_config(config.model_dir)
    weight_dtype = model_config.dtype if config.weight_dtype == "auto" else config.weight_dtype
    kv_dtype = weight_dtype if config.kv_dtype == "auto" else config.kv_dtype
    if config.threads:
        torch.set_num_threads(config.threads)
    t0 = time.perf_counter()
    model = DecoderModel(model_config, load_weights(config.model_dir), dtype=TORCH_DTYPES[weight_dtype])
    layout = KvLayout(
        num_layers=model_config.num_layers,
        num_kv_heads=model_config.num_kv_heads,
        head_dim=model_config.head_dim,
        block_size=config.block_size,
        dtype=kv_dtype,
    )
    engine = DecodeEngine(model, layout, config.num_blocks, config.max_running)
    log.info("decode model %s loaded in %.1f s; KV cache %d blocks x %d tokens (%s, %.1f MiB)",
             model_config.describe(), time.perf_counter() - t0, config.num_blocks, config.block_size,
             kv_dtype, config.num_blocks * config.block_size * layout.bytes_per_token / 2**20)
    return model_config, engine, layout


async def start(config: DecodeConfig) -> DecodeWorker:
    model_config, engine, layout = build_engine(config)
    digest = fingerprint(config.model_dir, model_config)
    receiver = KvReceiver(layout, digest, engine)
    server, health, port = serving.new_server(SERVICES, config.port, config.host)
    service = DecodeService(
        engine, receiver, fingerprint=digest, description=model_config.describe(),
        eos_ids=frozenset(model_config.eos_token_ids), max_model_len=model_config.max_model_len,
        address=f"{config.host}:{port}",
    )
    worker_pb2_grpc.add_DecodeServicer_to_server(service, server)
    worker_pb2_grpc.add_ControlServicer_to_server(service, server)
    worker_pb2_grpc.add_KvTransferServicer_to_server(receiver, server)
    await server.start()
    await serving.set_serving(health, SERVICES, True)
    log.info("decode worker listening on %s:%d", config.host, port)
    return DecodeWorker(server, service, engine, port)


async def serve(config: DecodeConfig) -> None:
    worker = await start(config)
    await serving.wait_for_signal()
    log.info("decode worker stopping")
    await worker.stop()
