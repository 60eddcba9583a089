"""A Hugging Face model id resolves through huggingface_hub's cache, offline, to a servable checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pdserve.server.model.config import ModelLoadError, load_config
from pdserve.server.model.hub import resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def hub_cache(model_dir: Path, cache: Path, repo_id: str, commit: str = COMMIT, ref: str = "main") -> Path:
    """The hub cache layout: models--org--name/{refs/<ref>, snapshots/<commit>/<files>}."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


def test_a_model_id_resolves_offline_from_the_cache_at_a_revision(tiny_model, tmp_path):
    cache = tmp_path / "hub"
    snapshot = hub_cache(tiny_model("llama"), cache, "pdserve-tests/tiny-llama")
    got = resolve_model("pdserve-tests/tiny-llama", download_dir=cache, offline=True)
    assert got == snapshot
    assert load_config(got).family == "llama"
    assert resolve_model("pdserve-tests/tiny-llama", revision=COMMIT, download_dir=cache, offline=True) == snapshot


def test_a_local_directory_is_itself(tiny_model):
    assert resolve_model(str(tiny_model("llama"))) == tiny_model("llama")


def test_a_model_missing_from_the_cache_offline_says_where_it_looked(tmp_path):
    with pytest.raises(ModelLoadError, match="not in the Hugging Face cache .*HF_HUB_OFFLINE"):
        resolve_model("pdserve-tests/absent", download_dir=tmp_path, offline=True)
    with pytest.raises(ModelLoadError, match="neither a directory nor a Hugging Face model id"):
        resolve_model("org/not an id!", download_dir=tmp_path, offline=True)
    assert resolve_model(tmp_path / "absent") == tmp_path / "absent"  # a path: load_config says it is missing
