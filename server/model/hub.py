"""`--model`: a local checkpoint directory, or a Hugging Face model id resolved through `huggingface_hub`.

A model id (`Qwen/Qwen3-0.6B`) is looked up in the Hugging Face cache (`--download-dir`, else
HF_HUB_CACHE / HF_HOME) at `--revision`, and downloaded there when missing, unless offline
(HF_HUB_OFFLINE=1), where only the cache is read. Only what pdserve reads is fetched: configs,
tokenizer files, chat templates and safetensors weights.
"""

from __future__ import annotations

from pathlib import Path

from pdserve.server.model.config import ModelLoadError

CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt"]


def is_local(model: str | Path) -> bool:
    """A directory, or what can only be a path (absolute, relative with ./ or ../, ~, or more than one
    '/'); a Hugging Face id is `name` or `org/name`."""
    text = str(model)
    return (Path(model).expanduser().is_dir() or text.startswith(("/", "./", "../", "~", "."))
            or text.count("/") > 1)


def resolve_model(model: str | Path, *, revision: str | None = None, download_dir: Path | None = None,
                  offline: bool | None = None) -> Path:
    """The checkpoint directory for a local path or a model id; ModelLoadError saying why not."""
    if is_local(model):  # a missing directory is for load_config to name
        return Path(model).expanduser()
    model = str(model)
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    offline = constants.HF_HUB_OFFLINE if offline is None else offline
    try:
        path = huggingface_hub.snapshot_download(
            repo_id=model, revision=revision, cache_dir=download_dir, allow_patterns=CHECKPOINT_FILES,
            local_files_only=offline,
        )
    except HFValidationError as e:
        raise ModelLoadError(f"{model!r} is neither a directory nor a Hugging Face model id: {e}") from e
    except LocalEntryNotFoundError as e:
        where = download_dir or constants.HF_HUB_CACHE
        raise ModelLoadError(f"{model!r} (revision {revision or 'main'}) is not in the Hugging Face cache {where}"
                             f"{' and HF_HUB_OFFLINE is set' if offline else ''}: {e}") from e
    except Exception as e:  # network, authorization, unknown repository
        raise ModelLoadError(f"cannot fetch {model!r} from the Hugging Face Hub: {e}") from e
    return Path(path)
