"""Starts one prefill worker process: load the model into JAX, compile, serve."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from kvcache.sender import KvSender
from pdserve.v1 import worker_pb2_grpc
from server import serving
from server.model.config import load_config
from server.model.fingerprint import fingerprint
from server.model.weights import load_weights
from server.prefill.config import PrefillConfig
from server.prefill.engine import PrefillEngine
from server.prefill.model import load_params
from server.prefill.service import PrefillService

log = logging.getLogger("pdserve.prefill")

SERVICES = ["pdserve.v1.Prefill", "pdserve.v1.Control"]


@dataclass
class PrefillWorker:
    server: object
    service: PrefillService
    port: int

    async def stop(self, grace: float = 1.0) -> None:
        await self.server.stop(grace)
        await self.service.sender.close()


async def start(config: PrefillConfig) -> PrefillWorker:
    model_config = load_config(config.model_dir)
    dtype = model_config.dtype if config.weight_dtype == "auto" else config.weight_dtype
    t0 = time.perf_counter()
    params = load_params(model_config, load_weights(config.model_dir), dtype=dtype)
    engine = PrefillEngine(model_config, params, config)
    engine.warmup()
    log.info("prefill model %s loaded and compiled in %.1f s", model_config.describe(), time.perf_counter() - t0)
    server, health, port = serving.new_server(SERVICES, config.port, config.host)
    service = PrefillService(engine, KvSender(channel_options=serving.CHANNEL_OPTIONS), model_config,
                             fingerprint=fingerprint(config.model_dir, model_config),
                             address=f"{config.host}:{port}")
    worker_pb2_grpc.add_PrefillServicer_to_server(service, server)
    worker_pb2_grpc.add_ControlServicer_to_server(service, server)
    await server.start()
    await serving.set_serving(health, SERVICES, True)
    log.info("prefill worker listening on %s:%d", config.host, port)
    return PrefillWorker(server, service, port)


async def serve(config: PrefillConfig) -> None:
    worker = await start(config)
    await serving.wait_for_signal()
    log.info("prefill worker stopping")
    await worker.stop()
