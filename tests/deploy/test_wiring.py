"""What the manifests start is the CLI the tests run, and every port, key and metric name lines up."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from pdserve.server.cli import build_parser
from tests.deploy.manifests import (
    DEPLOY,
    KUSTOMIZATIONS,
    POD_IP,
    POD_NAME,
    POD_NAMESPACE,
    by_kind,
    config_maps,
    container_ports,
    named,
    option,
    processes,
    render,
    selects,
)

TIERS = {"pdserve-coordinator": "coordinator", "pdserve-prefill": "prefill", "pdserve-decode": "decode"}
# The port each flag opens, by the container port's name.
PORT_FLAGS = {"grpc": "--port", "http": "--http-port", "metrics": "--metrics-port", "kv": "--kv-port"}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: render(path) for name, path in KUSTOMIZATIONS.items()}


def subcommand_options(command: str) -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._subparsers._group_actions if a.dest == "command")  # noqa: SLF001
    return {s for action in sub.choices[command]._actions for s in action.option_strings}  # noqa: SLF001


@pytest.mark.parametrize("kustomization", list(KUSTOMIZATIONS))
def test_every_container_runs_a_pdserve_command_that_parses(rendered, kustomization):
    procs = processes(rendered[kustomization]) + processes(rendered[kustomization], init=True)
    assert sorted(p.deployment for p in processes(rendered[kustomization])) == sorted(TIERS)
    for proc in procs:
        assert proc.argv[0] == "pdserve", proc.name
        args = build_parser().parse_args(proc.argv[1:])
        if proc.container["name"] in TIERS.values():
            assert args.command == TIERS[proc.deployment], proc.name
            assert args.host == "0.0.0.0", proc.name
            assert str(args.model) == "/models/model", proc.name
            assert option(proc.argv, "--log-format") == "json", proc.name
            if args.command != "coordinator":
                assert args.coordinator == "pdserve-coordinator-registry:50051", proc.name
                # Plaintext: the pod IP. mTLS (gke): the pod's DNS name under its headless Service,
                # which its certificate carries.
                pod = named(rendered[kustomization], "Deployment", proc.deployment)["spec"]["template"]
                if kustomization == "gke":
                    subdomain = named(rendered[kustomization], "Service", pod["spec"]["subdomain"])["spec"]
                    assert subdomain["clusterIP"] == "None" and subdomain["publishNotReadyAddresses"] is True
                    assert selects({"matchLabels": subdomain["selector"]}, pod["metadata"]["labels"])
                    host = f"{POD_NAME}.{pod['spec']['subdomain']}.{POD_NAMESPACE}.svc"
                else:
                    assert "subdomain" not in pod["spec"]
                    host = POD_IP
                assert args.advertise_address == f"{host}:{args.port}", proc.name
        else:
            assert args.command == "make-tiny-model" and str(args.dir) == "/models/model", proc.name


@pytest.mark.parametrize("kustomization", list(KUSTOMIZATIONS))
def test_ports_and_probes_are_the_ports_the_process_listens_on(rendered, kustomization):
    for proc in processes(rendered[kustomization]):
        ports = container_ports(proc.container)
        listens = {name: int(option(proc.argv, flag)) for name, flag in PORT_FLAGS.items()
                   if option(proc.argv, flag) is not None}
        assert ports == listens, proc.name
        grpc_port = listens["grpc"]
        for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = proc.container[probe_name]
            if "grpc" in probe:
                assert probe["grpc"] == {"port": grpc_port}, (proc.name, probe_name)
            elif "tcpSocket" in probe:
                assert probe["tcpSocket"] == {"port": grpc_port}, (proc.name, probe_name)
            else:  # the mtls component's exec of the image's health check
                command = probe["exec"]["command"]
                assert command[:2] == ["/opt/pdserve/bin/python", "/usr/local/bin/pdserve-healthcheck"]
                assert command[2:] == [f"--port={grpc_port}"], (proc.name, probe_name)
        # Liveness never asks for SERVING: a draining worker, or a coordinator with empty pools, says
        # NOT_SERVING and must not be restarted for it.
        assert "tcpSocket" in proc.container["livenessProbe"], proc.name
        assert {"name": "PDSERVE_HEALTH_PORT", "value": str(grpc_port)} in proc.container["env"], proc.name


@pytest.mark.parametrize("kustomization", list(KUSTOMIZATIONS))
def test_config_map_keys_are_the_flags_they_feed(rendered, kustomization):
    objects = rendered[kustomization]
    maps = config_maps(objects)
    used: dict[str, set[str]] = {name: set() for name in maps}
    for proc in processes(objects):
        raw_args = proc.container["args"]
        flags = subcommand_options(TIERS[proc.deployment])
        for env, (cm, key) in proc.env_keys.items():
            assert f"--{key}" in flags, f"{proc.name}: ConfigMap key {key!r} is no flag of pdserve {TIERS[proc.deployment]}"
            assert f"--{key}=$({env})" in raw_args, f"{proc.name}: {env} (key {key}) does not feed --{key}"
            assert option(proc.argv, f"--{key}") == maps[cm][key]
            used[cm].add(key)
        # Every ConfigMap value that reaches the command line does so through its own flag.
        assert all(re.fullmatch(r"--[a-z-]+=\$\(PDSERVE_[A-Z_]+\)", a) for a in raw_args if "$(PDSERVE_" in a)
    for cm, keys in maps.items():
        assert keys.keys() == used[cm], f"ConfigMap {cm}: keys no container reads: {set(keys) - used[cm]}"


@pytest.mark.parametrize("kustomization", list(KUSTOMIZATIONS))
def test_services_select_pods_and_name_their_ports(rendered, kustomization):
    objects = rendered[kustomization]
    for service in by_kind(objects, "Service"):
        pods = [d for d in by_kind(objects, "Deployment")
                if selects({"matchLabels": service["spec"]["selector"]}, d["spec"]["template"]["metadata"]["labels"])]
        assert len(pods) == 1, service["metadata"]["name"]
        ports = container_ports(pods[0]["spec"]["template"]["spec"]["containers"][0])
        for port in service["spec"]["ports"]:
            assert ports[port["targetPort"]] == port["port"], (service["metadata"]["name"], port)
    registry = named(objects, "Service", "pdserve-coordinator-registry")
    assert registry["spec"]["publishNotReadyAddresses"] is True  # workers register before it is ready


def reachable(objects: list[dict], source: str, target: str, port: int) -> bool:
    """Whether a pod of tier `source` (or 'monitoring' / 'outside') may open `port` on tier `target`."""
    target_labels = named(objects, "Deployment", target)["spec"]["template"]["metadata"]["labels"]
    source_labels = (named(objects, "Deployment", source)["spec"]["template"]["metadata"]["labels"]
                     if source.startswith("pdserve-") else {})
    policies = [p for p in by_kind(objects, "NetworkPolicy") if selects(p["spec"]["podSelector"], target_labels)]
    assert policies, f"no NetworkPolicy isolates {target}"
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            if "ports" in rule and port not in [p["port"] for p in rule["ports"]]:
                continue
            if "from" not in rule:
                return True
            for peer in rule["from"]:
                if "podSelector" in peer and source_labels and selects(peer["podSelector"], source_labels):
                    return True
                ns = peer.get("namespaceSelector", {}).get("matchLabels", {})
                if source == "monitoring" and ns == {"kubernetes.io/metadata.name": "monitoring"}:
                    return True
    return False


@pytest.mark.parametrize("kustomization", list(KUSTOMIZATIONS))
def test_network_policies(rendered, kustomization):
    objects = rendered[kustomization]
    ports = {d: dict(container_ports(named(objects, "Deployment", d)["spec"]["template"]["spec"]["containers"][0]))
             for d in TIERS}
    sources = [*TIERS, "monitoring", "outside"]
    allowed = {(s, t, name) for t in TIERS for name, port in ports[t].items() for s in sources
               if reachable(objects, s, t, port)}
    expected = (
        {(s, "pdserve-coordinator", p) for s in sources for p in ("grpc", "http")}
        | {(s, "pdserve-coordinator", "metrics") for s in ["monitoring"]}
        | {("pdserve-coordinator", "pdserve-prefill", "grpc"), ("pdserve-coordinator", "pdserve-decode", "grpc")}
        | {("pdserve-prefill", "pdserve-decode", "kv")}
        | {("monitoring", t, "metrics") for t in ("pdserve-prefill", "pdserve-decode")}
    )
    assert allowed == expected


def agreed_metric_names() -> set[str]:
    """The series pdserve's processes export, as server/metrics.py declares them."""
    import pdserve.server.metrics as metrics

    suffixes = {"gauge": [""], "counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
    names = set()
    for metric in metrics.FAMILIES:
        for family in metric.describe():
            names |= {family.name + s for s in suffixes[family.type]}
    return names


def adapter_metrics() -> dict[str, str]:
    """prometheus-adapter's rules: the custom metric name served -> the Prometheus series it reads."""
    values = yaml.safe_load((DEPLOY / "prometheus-adapter" / "values.yaml").read_text())
    assert values["rules"]["default"] is False
    served = {}
    for rule in values["rules"]["custom"]:
        series = re.fullmatch(r"([a-z_:][a-z0-9_:]*)\{[^}]*\}", rule["seriesQuery"]).group(1)
        as_name = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series)
        assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
        assert "<<.Series>>{<<.LabelMatchers>>}" in rule["metricsQuery"]
        served[as_name] = series
    return served


def test_autoscalers_read_metrics_pdserve_exports(rendered):
    exported = agreed_metric_names()
    served = adapter_metrics()
    assert set(served.values()) <= exported, set(served.values()) - exported
    for kustomization, objects in rendered.items():
        hpas = {h["metadata"]["name"]: h for h in by_kind(objects, "HorizontalPodAutoscaler")}
        # gke runs coordinator replicas too, scaled on their in-flight requests
        assert sorted(hpas) == ["pdserve-coordinator"] * (kustomization == "gke") + ["pdserve-decode", "pdserve-prefill"]
        for name, hpa in hpas.items():
            assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
            names = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]]
            assert set(names) <= set(served), (name, set(names) - set(served))
        assert [m["pods"]["metric"]["name"] for m in hpas["pdserve-prefill"]["spec"]["metrics"]] == [
            "pdserve_prefill_queued_seconds"]
        assert [m["pods"]["metric"]["name"] for m in hpas["pdserve-decode"]["spec"]["metrics"]] == [
            "pdserve_kv_cache_usage_perc", "pdserve_num_requests_waiting"]
        if "pdserve-coordinator" in hpas:
            assert [m["pods"]["metric"]["name"] for m in hpas["pdserve-coordinator"]["spec"]["metrics"]] == [
                "pdserve_num_requests_running"]


def test_gke_runs_two_coordinator_replicas_at_least_and_workers_register_with_every_one(rendered):
    objects = rendered["gke"]
    assert named(objects, "Deployment", "pdserve-coordinator")["spec"]["replicas"] >= 2
    (hpa,) = [h for h in by_kind(objects, "HorizontalPodAutoscaler") if h["metadata"]["name"] == "pdserve-coordinator"]
    assert hpa["spec"]["minReplicas"] >= 2
    # workers dial the headless registry Service: its DNS name resolves to every replica (registration.py)
    registry = named(objects, "Service", "pdserve-coordinator-registry")
    assert registry["spec"]["clusterIP"] == "None" and registry["spec"]["publishNotReadyAddresses"] is True
    for proc in processes(objects):
        if proc.deployment != "pdserve-coordinator":
            assert option(proc.argv, "--coordinator") == "pdserve-coordinator-registry:50051", proc.name


def test_pod_monitor_scrapes_every_tier_on_its_metrics_port(rendered):
    objects = rendered["base"]
    (monitor,) = by_kind(objects, "PodMonitor")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    scraped = [p for p in processes(objects)
               if selects(monitor["spec"]["selector"], named(objects, "Deployment", p.deployment)
                          ["spec"]["template"]["metadata"]["labels"])]
    assert sorted(p.deployment for p in scraped) == sorted(TIERS)
    for proc in scraped:
        assert container_ports(proc.container)[endpoint["port"]] == int(option(proc.argv, "--metrics-port"))


@pytest.mark.parametrize("kustomization", list(KUSTOMIZATIONS))
def test_termination_grace_covers_the_drain(rendered, kustomization):
    objects = rendered[kustomization]
    default_timeout = float(config_maps(objects)[next(n for n in config_maps(objects)
                                                      if n.startswith("pdserve-coordinator"))]["default-timeout"])
    for proc in processes(objects):
        spec = named(objects, "Deployment", proc.deployment)["spec"]["template"]["spec"]
        pre_stop = proc.container["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep"
        drain = float(pre_stop[1]) + (default_timeout if proc.deployment != "pdserve-prefill" else 60)
        assert spec["terminationGracePeriodSeconds"] >= drain, proc.name


def test_gke_puts_prefill_on_tpu_and_decode_on_gpu(rendered):
    objects = rendered["gke"]
    prefill = named(objects, "Deployment", "pdserve-prefill")["spec"]["template"]["spec"]
    decode = named(objects, "Deployment", "pdserve-decode")["spec"]["template"]["spec"]
    coordinator = named(objects, "Deployment", "pdserve-coordinator")["spec"]["template"]["spec"]
    assert prefill["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
                                       "cloud.google.com/gke-tpu-topology": "2x2"}
    assert prefill["containers"][0]["resources"]["limits"]["google.com/tpu"] == "4"
    assert prefill["containers"][0]["resources"]["requests"]["google.com/tpu"] == "4"
    assert {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"} in prefill["tolerations"]
    assert decode["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    assert decode["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in decode["tolerations"]
    assert "nodeSelector" not in coordinator and "tolerations" not in coordinator
    for spec in (prefill, decode, coordinator):
        assert next(v for v in spec["volumes"] if v["name"] == "tls")["csi"]["driver"] == "csi.cert-manager.io"
    # Every name a peer dials is in the certificate of the pod it reaches.
    for proc in processes(objects):
        pod = named(objects, "Deployment", proc.deployment)["spec"]["template"]["spec"]
        attributes = next(v for v in pod["volumes"] if v["name"] == "tls")["csi"]["volumeAttributes"]
        sans = attributes["csi.cert-manager.io/dns-names"].split(",")
        assert attributes["csi.cert-manager.io/ip-sans"] == "127.0.0.1"  # the pod's own health check
        if proc.deployment == "pdserve-coordinator":
            dialed = ["pdserve-coordinator", "pdserve-coordinator-registry"]
        else:  # the advertised host as the manifest writes it, in the CSI driver's ${VAR} syntax
            host = option(proc.container["args"], "--advertise-address").rsplit(":", 1)[0]
            dialed = [host.replace("$(", "${").replace(")", "}")]
        assert set(dialed) <= set(sans), (proc.name, dialed, sans)
        assert option(proc.argv, "--tls-ca") == "/etc/pdserve/tls/ca.crt", proc.name
        assert option(proc.argv, "--tls-cert") == "/etc/pdserve/tls/tls.crt", proc.name
        assert option(proc.argv, "--tls-key") == "/etc/pdserve/tls/tls.key", proc.name


def test_cpu_needs_no_accelerator_and_builds_its_model(rendered):
    objects = rendered["cpu"]
    text = yaml.safe_dump_all(objects)
    assert "google.com/tpu" not in text and "nvidia.com/gpu" not in text and "nodeSelector" not in text
    for deployment in by_kind(objects, "Deployment"):
        spec = deployment["spec"]["template"]["spec"]
        assert deployment["spec"]["replicas"] == 1
        assert next(v for v in spec["volumes"] if v["name"] == "model") == {"name": "model", "emptyDir": {}}
        assert [c["name"] for c in spec["initContainers"]] == ["make-tiny-model"]
    for proc in processes(objects):
        assert option(proc.argv, "--tls-ca") is None, proc.name


def test_images_are_one_per_tier(rendered):
    for kustomization, objects in rendered.items():
        for proc in processes(objects):
            image = proc.container["image"]
            assert Path(image.split(":")[0]).name == f"pdserve-{TIERS[proc.deployment]}", (kustomization, image)
