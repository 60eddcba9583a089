"""vLLM's LoRA endpoints on the OpenAI front: adapters in `GET /v1/models`, and with
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`.

Answers as vLLM 0.32's (`entrypoints/openai/models/serving.py`): 200 with a plain-text "Success: ..." line; 400
InvalidUserInput for a missing field, a base model's name or a name already loaded (without load_inplace); 404
NotFoundError for a path holding no adapter, or unloading a name not loaded. An adapter pdserve cannot serve (its
shapes, rank or format) is a 400 BadRequestError naming why (vLLM answers 500 there).
"""

from __future__ import annotations

import os
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from pdserve.server.coordinator.adapters import Adapter, AdapterExists
from pdserve.server.coordinator.openai.errors import ApiError
from pdserve.server.coordinator.openai.front import Front
from pdserve.server.lora_config import LoraModule
from pdserve.server.model.lora import LoraLoadError, LoraNotFound


def runtime_lora_updating() -> bool:
    """vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING ("1" or "true", any case)."""
    return os.getenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true")


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str = ""
    lora_int_id: int | None = None


def lora_card(front: Front, adapter: Adapter) -> dict[str, Any]:
    """An adapter's /v1/models entry, as vLLM lists it."""
    return {"id": adapter.name, "object": "model", "created": front.created, "owned_by": "pdserve",
            "root": adapter.path, "parent": adapter.base_model_name or front.model_name, "max_model_len": None}


def add_lora_routes(app: FastAPI, front: Front, authenticate) -> None:
    adapters = front.adapters
    assert adapters is not None

    @app.post("/v1/load_lora_adapter", dependencies=[Depends(authenticate)])
    async def load_lora_adapter(body: LoadLoraAdapterRequest) -> Response:
        name, path = body.lora_name, body.lora_path
        if not name or not path:
            raise ApiError(400, "Both 'lora_name' and 'lora_path' must be provided.", type="InvalidUserInput")
        if name == front.model_name or name in front.aliases:
            raise ApiError(400, f"The lora adapter '{name}' conflicts with a served base model.",
                           type="InvalidUserInput")
        try:
            await adapters.load(LoraModule(name, path), inplace=body.load_inplace)
        except AdapterExists as e:
            raise ApiError(400, str(e), type="InvalidUserInput") from e
        except LoraNotFound as e:
            raise ApiError(404, str(e)) from e
        except LoraLoadError as e:
            raise ApiError(400, str(e), type="BadRequestError") from e
        return Response(f"Success: LoRA adapter '{name}' added successfully.", status_code=200)

    @app.post("/v1/unload_lora_adapter", dependencies=[Depends(authenticate)])
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest) -> Response:
        name = body.lora_name
        if not name:
            raise ApiError(400, "'lora_name' needs to be provided to unload a LoRA adapter.", type="InvalidUserInput")
        try:
            await adapters.unload(name)
        except KeyError:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.") from None
        return Response(f"Success: LoRA adapter '{name}' removed successfully.", status_code=200)
