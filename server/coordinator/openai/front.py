"""What the OpenAI endpoints need from the coordinator, and the names it serves the model under."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from tokenizers import Tokenizer as HfTokenizer

from pdserve.server.cluster_metrics import Target
from pdserve.server.coordinator.adapters import Adapters
from pdserve.server.coordinator.chat_template import ChatTemplate
from pdserve.server.coordinator.json_input import printable
from pdserve.server.coordinator.openai.errors import ApiError
from pdserve.server.coordinator.service import GenerationService


@dataclass
class Front:
    """What the endpoints need from the coordinator."""

    generation: GenerationService
    model_name: str
    aliases: tuple[str, ...]
    """Other names a request may give `model` (the checkpoint path, as vLLM names it)."""
    max_model_len: int
    chat: ChatTemplate | None
    ready: Callable[[], bool]
    api_key: str | None = None
    timeout: float | None = None
    created: int = 0
    encoder: HfTokenizer | None = None
    """For /tokenize without special tokens (vLLM's extension); None: the endpoint answers 501."""
    max_body_bytes: int = 16 * 2**20
    """Larger request bodies get 413 before they are read."""
    max_prompt_bytes: int = 4 * 2**20
    """Larger prompts (and chat messages together) get 413 before they are tokenized or rendered."""
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    """tool_choice "auto": the format calls are parsed from (tool_parsers.py); None: "auto" is refused."""
    worker_metrics: tuple[Target, ...] = ()
    """Workers whose /metrics `GET /metrics` serves beside the coordinator's (`--worker-metrics`)."""

    def token_text(self, token_id: int) -> str:
        """One token's text, as logprobs name it."""
        return _token_text(self.generation.tokenizer, token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """One token's bytes (chat logprobs' `bytes`): a part of a character is its own bytes, not U+FFFD's."""
        table = getattr(self.generation.tokenizer, "token_bytes", None)
        if isinstance(table, list) and 0 <= token_id < len(table):
            return table[token_id]
        return self.token_text(token_id).encode()

    @property
    def adapters(self) -> Adapters | None:
        """The LoRA adapters served (--enable-lora), None without."""
        return getattr(self.generation, "adapters", None)

    def check_model(self, model: str) -> str | None:
        """The LoRA adapter `model` names (None: the base model, by any of its names); vLLM's 404 for a name
        served by neither."""
        if model == self.model_name or model in self.aliases:
            return None
        adapters = self.adapters
        if adapters is not None and adapters.get(model) is not None:
            return model
        raise ApiError(404, f"The model `{printable(model)}` does not exist.", param="model")


@lru_cache(maxsize=65536)
def _token_text(tokenizer: Any, token_id: int) -> str:
    """The tokenizer's `token_text` (a SentencePiece "▁" a space even at the start), else the id decoded alone."""
    if hasattr(tokenizer, "token_text"):
        return tokenizer.token_text(token_id)
    return tokenizer.decode([token_id], skip_special_tokens=False)
