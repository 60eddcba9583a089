"""`pdserve up --metrics-port` (and the coordinator's HTTP /metrics under `pdserve up`, `--worker-metrics`):
one /metrics with every process's series, each labelled by its process.

Life cycle: `serve_cluster_metrics` starts an HTTP server (a daemon thread) whose every GET scrapes each
live process's own /metrics concurrently (`SCRAPE_TIMEOUT` each), adds the process's labels to each
sample (`engine`, vLLM's label for its engine index, and `worker`, the process's name) and serves them
beside this process's own series: one HELP/TYPE per family, counters and histograms as the process wrote
them. `pdserve_worker_up` says, per process, whether this scrape reached it (0: dead, restarting, or no
answer in time; its series are then absent, and come back once it serves again).

The merge works on the text, line by line (prometheus_client writes each family's samples under its
HELP/TYPE): parsing four processes' exposition into objects and writing it back cost ~170 ms of CPU per
scrape, inside the coordinator when its HTTP /metrics merges; this costs a few.
"""

from __future__ import annotations

import logging
import re
import threading
import urllib.request
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

log = logging.getLogger("pdserve.metrics")

SCRAPE_TIMEOUT = 2.0
"""Seconds one process's /metrics may take before this scrape goes on without it."""
ENGINE, WORKER = "engine", "worker"
"""The labels added to a process's series: its index in the cluster (as vLLM's `engine="0"`) and its name."""


@dataclass(frozen=True)
class Target:
    """One process whose /metrics is merged."""

    name: str
    """e.g. decode-0 (the `worker` label; the state file's key)."""
    engine: int
    """Its index in the cluster, stable across restarts (the `engine` label)."""
    role: str
    address: str
    """host:port of its own /metrics."""
    alive: bool = True
    """False while it is dead (not scraped)."""


def targets_of(worker_metrics: list[str]) -> list[Target]:
    """The targets `--worker-metrics NAME=HOST:PORT` names, `engine` their place in the list (the role: NAME
    up to its first '-', as `pdserve up` names its processes)."""
    out = []
    for i, entry in enumerate(worker_metrics):
        name, _, address = entry.partition("=")
        out.append(Target(name, i, name.partition("-")[0], address))
    return out


def scrape(address: str, timeout: float = SCRAPE_TIMEOUT) -> str | None:
    """The exposition text at http://address/metrics, or None where it does not answer in time."""
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout) as reply:
            return reply.read().decode()
    except (OSError, ValueError) as e:  # refused, reset, timed out, a bad status
        log.debug("scraping %s failed: %r", address, e)
        return None


UP_HELP = ("# HELP pdserve_worker_up 1 if this scrape read the process's /metrics, 0 if it is dead or did not "
           "answer in time (its series are then absent)")
_HEADER = re.compile(r"# (HELP|TYPE) (\S+)")
_OURS = re.compile(r'(?<=\{)(?:engine|worker)="(?:[^"\\]|\\.)*",?|,(?:engine|worker)="(?:[^"\\]|\\.)*"')
"""An engine or worker label a process set itself (vLLM's own engine index): ours replace it."""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(target: Target) -> str:
    return f'{ENGINE}="{target.engine}",{WORKER}="{_escape(target.name)}"'


def _name_end(line: str) -> int:
    """Where a sample line's metric name ends (at its label set or the space before its value)."""
    brace, space = line.find("{"), line.find(" ")
    return brace if 0 <= brace < space or space < 0 else space


def _labelled(line: str, labels: str) -> str:
    """A sample line with `labels` first in its label set."""
    cut = _name_end(line)
    if cut < 0:
        return line
    if line[cut] == " ":
        return f"{line[:cut]}{{{labels}}}{line[cut:]}"
    rest = line[cut:]
    if 'engine="' in rest or 'worker="' in rest:
        rest = _OURS.sub("", rest, count=2)
    return f"{line[:cut]}{{{labels}{'' if rest[1] == '}' else ','}{rest[1:]}"


@dataclass
class _Family:
    help: str | None = None
    type: str | None = None
    samples: list[str] = field(default_factory=list)


def _add(families: dict[str, _Family], text: str, labels: str) -> None:
    """Files each sample line of `text` under its family (labelled), a family's HELP/TYPE kept from the first
    text that has them; a family this text types otherwise is left out of its share."""
    name, family, skip = "", None, False
    for line in text.splitlines():
        if not line:
            continue
        if line[0] == "#":
            header = _HEADER.match(line)
            if header is None:
                continue  # another comment
            if header[2] != name:
                name, skip = header[2], False
                family = families.setdefault(name, _Family())
            if header[1] == "HELP":
                family.help = family.help or line
            elif family.type is None:
                family.type = line
            else:
                skip = family.type != line
            continue
        if " " not in line:
            continue  # no value: not a sample (Prometheus would refuse the whole scrape)
        if family is None or not line.startswith(name) or line[len(name):len(name) + 1] not in ("_", "{", " "):
            name, skip = line[:max(0, _name_end(line))], False  # a sample without a header: untyped
            family = families.setdefault(name, _Family())
        if not skip:
            family.samples.append(_labelled(line, labels) if labels else line)


def merge(own: str, scraped: Iterable[tuple[Target, str | None]], model_name: str = "") -> str:
    """One exposition text: the families of `own` (this process's text, kept as is) and of each target's text
    (None: not reached), each target's samples with its `engine` and `worker` labels (replacing any it set
    itself); one HELP/TYPE per family, the first text's. A family a target types otherwise is left out of
    that target's share (Prometheus would refuse the mix). Then `pdserve_worker_up`, one sample per target."""
    families: dict[str, _Family] = {}
    _add(families, own, "")
    up = [UP_HELP, "# TYPE pdserve_worker_up gauge"]
    for target, text in scraped:
        if text is not None:
            _add(families, text, _labels(target))
        up.append(f'pdserve_worker_up{{model_name="{_escape(model_name)}",role="{_escape(target.role)}",'
                  f'{_labels(target)}}} {0.0 if text is None else 1.0}')
    out = [line for f in families.values() for line in (*filter(None, (f.help, f.type)), *f.samples)]
    return "\n".join([*out, *up, ""])


def cluster_text(targets: list[Target], model_name: str = "", own=REGISTRY, timeout: float = SCRAPE_TIMEOUT) -> str:
    """This process's registry and every live target's /metrics (scraped concurrently), merged (`merge`)."""
    live = [t for t in targets if t.alive]
    texts: dict[str, str | None] = {}
    if live:
        with ThreadPoolExecutor(len(live), thread_name_prefix="scrape") as pool:
            texts = dict(zip((t.name for t in live), pool.map(lambda t: scrape(t.address, timeout), live)))
    return merge(generate_latest(own).decode(), [(t, texts.get(t.name)) for t in targets], model_name)


def serve_cluster_metrics(port: int, host: str, targets: Callable[[], list[Target]], model_name: str = "",
                          own=REGISTRY) -> int:
    """Serves the merged /metrics (this process's `own` registry and every target's) on host:port (0: off) from
    a daemon thread; returns the port bound."""
    if not port:
        return 0

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = cluster_text(targets(), model_name, own=own).encode()
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass  # a scrape every few seconds is not news

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="cluster-metrics", daemon=True).start()
    bound = server.server_address[1]
    log.info("every process's Prometheus metrics on http://%s:%d/metrics (labelled %s and %s)", host, bound,
             ENGINE, WORKER)
    return bound
