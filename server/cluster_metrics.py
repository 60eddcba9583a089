"""`pdserve up --metrics-port` (and the coordinator's HTTP /metrics under `pdserve up`, `--worker-metrics`):
one /metrics with every process's series, each labelled by its process.

Life cycle: `serve_cluster_metrics` starts an HTTP server (a daemon thread) whose every GET scrapes each
live process's own /metrics concurrently (`SCRAPE_TIMEOUT` each), parses the text, adds the process's
labels to each sample (`engine`, vLLM's label for its engine index, and `worker`, the process's name) and
re-exposes them beside the supervisor's own series: one HELP/TYPE per family, counters and histograms as
the process wrote them. `pdserve_worker_up` says, per process, whether this scrape reached it (0: dead,
restarting, or no answer in time; its series are then absent, and come back once it serves again).
"""

from __future__ import annotations

import logging
import urllib.request
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

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


def merge(own: str, scraped: Iterable[tuple[Target, str | None]], model_name: str = "") -> list[Metric]:
    """The families of `own` (this process's text, kept as is) and of each target's text (None: not reached),
    each target's samples with its `engine` and `worker` labels (replacing any it set itself); one family
    per name, the first text's help and type. A family a target declares with another type is left out
    of that target's share (Prometheus would refuse the mix)."""
    families: dict[str, Metric] = {}
    up = GaugeMetricFamily("pdserve_worker_up", "1 if this scrape read the process's /metrics, 0 if it is dead "
                           "or did not answer in time (its series are then absent)",
                           labels=["model_name", "role", ENGINE, WORKER])
    sources: list[tuple[dict[str, str], str]] = [({}, own)]
    for target, text in scraped:
        up.add_metric([model_name, target.role, str(target.engine), target.name], 0.0 if text is None else 1.0)
        if text is not None:
            sources.append(({ENGINE: str(target.engine), WORKER: target.name}, text))
    for extra, text in sources:
        try:
            parsed = list(text_string_to_metric_families(text))
        except ValueError as e:  # a process that wrote something else than the exposition format
            log.warning("unreadable /metrics text (%s); its series are left out", e)
            continue
        for family in parsed:
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            elif merged.type != family.type:
                continue
            merged.samples.extend(s._replace(labels={**s.labels, **extra}) for s in family.samples)
    families[up.name] = up
    return list(families.values())


class ClusterCollector:
    """A prometheus_client collector: this process's registry plus every target's series (`merge`)."""

    def __init__(self, targets: Callable[[], list[Target]], model_name: str = "", own=REGISTRY,
                 timeout: float = SCRAPE_TIMEOUT):
        self.targets = targets
        self.model_name = model_name
        self.own = own
        self.timeout = timeout

    def describe(self) -> list[Metric]:
        return []  # the names change as processes come and go: never checked for clashes

    def collect(self) -> list[Metric]:
        targets = self.targets()
        live = [t for t in targets if t.alive]
        texts: dict[str, str | None] = {}
        if live:
            with ThreadPoolExecutor(len(live), thread_name_prefix="scrape") as pool:
                texts = dict(zip((t.name for t in live), pool.map(lambda t: scrape(t.address, self.timeout), live)))
        own = generate_latest(self.own).decode()
        return merge(own, [(t, texts.get(t.name)) for t in targets], self.model_name)


def render(collector: ClusterCollector) -> str:
    """The merged exposition text (what a GET of the served /metrics answers)."""
    registry = CollectorRegistry(auto_describe=False, support_collectors_without_names=True)
    registry.register(collector)
    return generate_latest(registry).decode()


def serve_cluster_metrics(port: int, host: str, targets: Callable[[], list[Target]], model_name: str = "") -> int:
    """Serves the merged /metrics on host:port (0: off) from a daemon thread; returns the port bound."""
    if not port:
        return 0
    registry = CollectorRegistry(auto_describe=False, support_collectors_without_names=True)
    registry.register(ClusterCollector(targets, model_name))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    bound = server.server_address[1]
    log.info("every process's Prometheus metrics on http://%s:%d/metrics (labelled %s and %s)", host, bound,
             ENGINE, WORKER)
    return bound
