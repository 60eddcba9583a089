"""The hardware catalog (catalog.json, shipped as package data): per accelerator its peak dense FLOP/s by
dtype, HBM capacity and bandwidth, links and on-demand price; and the shapes of a few models to plan
for. A user's own file (`--catalog`) replaces it; every entry is checked, a bad one refused by field."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Literal

Dtype = Literal["bf16", "fp8", "fp4"]
DTYPES: tuple[Dtype, ...] = ("bf16", "fp8", "fp4")
BYTES: dict[Dtype, float] = {"bf16": 2.0, "fp8": 1.0, "fp4": 0.5}
Kind = Literal["gpu", "tpu", "cpu"]


class CatalogError(ValueError):
    """A catalog entry is wrong; the message names the entry and the field."""


@dataclass(frozen=True)
class Accelerator:
    name: str
    kind: Kind
    peak_flops: dict[str, float | None]
    """FLOP/s by dtype (None: no such path)."""
    hbm_bytes: float
    hbm_bytes_per_s: float
    network_bytes_per_s: float
    """Per chip, to another host: what the KV handoff between tiers crosses."""
    price_per_hour: float | None
    """USD per chip-hour on demand; None: not published (plans on it need --price)."""

    def flops(self, dtype: Dtype) -> float | None:
        return self.peak_flops.get(dtype)


@dataclass(frozen=True)
class ModelShape:
    name: str
    params: float
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    vocab: int

    def kv_bytes_per_token(self, dtype: Dtype) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * BYTES[dtype]

    def weight_bytes(self, dtype: Dtype) -> float:
        return self.params * BYTES[dtype]


@dataclass(frozen=True)
class Catalog:
    date: str
    accelerators: dict[str, Accelerator]
    models: dict[str, ModelShape]

    def accelerator(self, name: str) -> Accelerator:
        if name not in self.accelerators:
            raise CatalogError(f"no accelerator {name!r} in the catalog; it has {', '.join(self.accelerators)}")
        return self.accelerators[name]

    def model(self, name: str) -> ModelShape:
        if name not in self.models:
            raise CatalogError(f"no model {name!r} in the catalog; it has {', '.join(self.models)}")
        return self.models[name]


def _number(entry: dict, key: str, where: str, *, positive: bool = True, optional: bool = False) -> float | None:
    value = entry.get(key)
    if value is None:
        if optional:
            return None
        raise CatalogError(f"{where}: field {key!r} is missing")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or \
            (value <= 0 if positive else value < 0):
        raise CatalogError(f"{where}: field {key!r} must be a number {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def _accelerator(entry: dict, n: int) -> Accelerator:
    if not isinstance(entry, dict):
        raise CatalogError(f"accelerators[{n}]: an entry must be an object")
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise CatalogError(f"accelerators[{n}]: field 'name' is missing")
    where = f"accelerator {name!r}"
    kind = entry.get("kind")
    if kind not in ("gpu", "tpu", "cpu"):
        raise CatalogError(f"{where}: field 'kind' must be gpu, tpu or cpu, got {kind!r}")
    peak = entry.get("peak_tflops")
    if not isinstance(peak, dict):
        raise CatalogError(f"{where}: field 'peak_tflops' is missing")
    flops = {d: (None if (v := _number(peak, d, f"{where} peak_tflops", optional=d != "bf16")) is None else v * 1e12)
             for d in DTYPES}
    links = entry.get("links")
    if not isinstance(links, dict):
        raise CatalogError(f"{where}: field 'links' is missing")
    return Accelerator(
        name=name, kind=kind, peak_flops=flops,
        hbm_bytes=_number(entry, "hbm_gib", where) * 2**30,
        hbm_bytes_per_s=_number(entry, "hbm_gb_per_s", where) * 1e9,
        network_bytes_per_s=_number(links, "network_gb_per_s", f"{where} links") * 1e9,
        price_per_hour=_number(entry, "price_per_chip_hour", where, optional=True))


def _model(entry: dict, n: int) -> ModelShape:
    name = entry.get("name") if isinstance(entry, dict) else None
    if not isinstance(name, str) or not name:
        raise CatalogError(f"models[{n}]: field 'name' is missing")
    where = f"model {name!r}"
    ints = {k: int(_number(entry, k, where)) for k in ("layers", "hidden", "kv_heads", "head_dim", "vocab")}
    return ModelShape(name, _number(entry, "params", where), **ints)


def parse(doc: dict, name: str = "catalog") -> Catalog:
    if not isinstance(doc, dict):
        raise CatalogError(f"{name}: a catalog is a JSON object")
    date = doc.get("date")
    if not isinstance(date, str) or not date:
        raise CatalogError(f"{name}: field 'date' is missing (when its figures were taken)")
    accs = [_accelerator(e, n) for n, e in enumerate(doc.get("accelerators") or [])]
    if not accs:
        raise CatalogError(f"{name}: field 'accelerators' holds no entries")
    models = [_model(e, n) for n, e in enumerate(doc.get("models") or [])]
    return Catalog(date, {a.name: a for a in accs}, {m.name: m for m in models})


def load(path: Path | None = None) -> Catalog:
    """The given catalog file, else the shipped one."""
    if path is None:
        text = resources.files("pdserve.server.plan").joinpath("catalog.json").read_text()
        name = "catalog.json"
    else:
        try:
            text = path.read_text()
        except OSError as e:
            raise CatalogError(f"cannot read the catalog {path}: {e.strerror}") from None
        name = str(path)
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise CatalogError(f"{name}: not JSON ({e.msg})") from None
    return parse(doc, name)
