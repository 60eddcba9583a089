"""A model's identity for the KV handshake: a digest of its config and its weights."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pdserve.server.model.config import ModelConfig
from pdserve.server.model.weights import checkpoint_files, read_header

_SAMPLE = 1 << 20  # bytes hashed at each end of every weight file


def fingerprint(model_dir: str | Path, config: ModelConfig) -> str:
    """sha256 over the canonical config, every tensor's name/dtype/shape and sampled weight bytes.

    Hashing every byte of a large checkpoint costs seconds per GB at each start, so each file
    contributes its header (names, shapes, offsets), its size and its first and last MiB.
    """
    h = hashlib.sha256()
    h.update(json.dumps(config.raw, sort_keys=True).encode())
    for path in checkpoint_files(model_dir):
        header, _ = read_header(path)
        h.update(json.dumps(header, sort_keys=True).encode())
        size = path.stat().st_size
        h.update(size.to_bytes(8, "little"))
        with open(path, "rb") as f:
            h.update(f.read(_SAMPLE))
            f.seek(max(0, size - _SAMPLE))
            h.update(f.read(_SAMPLE))
    return h.hexdigest()
