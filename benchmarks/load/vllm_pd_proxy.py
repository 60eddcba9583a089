"""The proxy in front of vLLM's own disaggregated prefill/decode (the side-by-side's `vllm-pd` peer).

    python -m pdserve.benchmarks.load.vllm_pd_proxy --prefill http://127.0.0.1:P --decode http://127.0.0.1:D --port N

Each `/v1/completions` request goes first to the prefill instance with `max_tokens: 1` (not streamed:
its KV lands in the connector's storage), then, unchanged, to the decode instance, whose stream is
relayed byte for byte (the decode instance loads the prompt's KV instead of computing it). This is what
vLLM's own disaggregated-serving example proxies do; the figures include its hop, as pdserve's include
its coordinator.
"""

from __future__ import annotations

import argparse

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


def build_app(prefill: str, decode: str) -> FastAPI:
    app = FastAPI()
    client = httpx.AsyncClient(timeout=None)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        r = await client.get(f"{decode}/v1/models")
        return JSONResponse(r.json(), status_code=r.status_code)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        first = dict(body, max_tokens=1, stream=False)
        first.pop("stream_options", None)
        r = await client.post(f"{prefill}/v1/completions", json=first)
        if r.status_code != 200:
            return JSONResponse(r.json(), status_code=r.status_code)
        if not body.get("stream"):
            r = await client.post(f"{decode}/v1/completions", json=body)
            return JSONResponse(r.json(), status_code=r.status_code)
        req = client.build_request("POST", f"{decode}/v1/completions", json=body)
        resp = await client.send(req, stream=True)

        async def relay():
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:
                await resp.aclose()

        return StreamingResponse(relay(), status_code=resp.status_code, media_type="text/event-stream")

    return app


def main() -> None:
    p = argparse.ArgumentParser(prog="vllm_pd_proxy", description=__doc__.split("\n")[0])
    p.add_argument("--prefill", required=True, help="the kv_producer instance's base URL")
    p.add_argument("--decode", required=True, help="the kv_consumer instance's base URL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    args = p.parse_args()
    uvicorn.run(build_app(args.prefill, args.decode), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
