"""deploy/: every overlay builds with kustomize (kubectl 1.37's), every resource
validates against the Kubernetes 1.33 schemas (strict: unknown fields fail), and
the ports, probes, environment names and metric names in the manifests are
the ones the code uses. The ServiceMonitor is a CRD with no schema here: its
shape is checked by hand below.
"""

from __future__ import annotations

import subprocess
from functools import cache

import kubernetes_validate
import pytest
import yaml

from gateway.routes import ops
from gateway.service import CUT_GRACE_S
from gateway.settings import GatewaySettings
from tests.deploy.conftest import REPO, exported_metric_names, tool
from workers.rpc.security import FILES
from workers.worker import WorkerSettings

K8S_VERSION = "1.33"  # the oldest Kubernetes these manifests are checked against
OVERLAYS = ["cpu", "gpu"]
ROLES = ["target", "draft"]
NOT_SETTINGS = {"SPECSPLIT_MODEL_CACHE"}  # read by the model loader, not a settings field
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}
MONITORING = {"kubernetes.io/metadata.name": "monitoring"}  # where Prometheus runs


@cache
def build(path: str) -> tuple[dict, ...]:
    result = subprocess.run(
        [tool("kubectl"), "kustomize", str(REPO / path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"kubectl kustomize {path}:\n{result.stderr}"
    return tuple(d for d in yaml.safe_load_all(result.stdout) if d)


def find(docs, kind: str, name: str | None = None) -> list[dict]:
    return [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]


def one(docs, kind: str, name: str) -> dict:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def container(docs, component: str) -> dict:
    deployment = one(docs, "Deployment", f"specsplit-{component}")
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def environment(docs, c: dict) -> dict[str, str]:
    """The container's environment: its ConfigMaps, then its literal values (secrets: '')."""
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        env |= one(docs, "ConfigMap", source["configMapRef"]["name"])["data"]
    for var in c.get("env", []):
        env[var["name"]] = var.get("value", "")
    return env


def port(c: dict, name: str) -> int:
    (p,) = [p["containerPort"] for p in c["ports"] if p["name"] == name]
    return p


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def worker_settings(role: str) -> WorkerSettings:
    return WorkerSettings(role=role)


@pytest.fixture(params=OVERLAYS)
def overlay(request) -> tuple[str, tuple[dict, ...]]:
    return request.param, build(f"deploy/overlays/{request.param}")


def test_overlays_validate_against_kubernetes_schemas(overlay):
    name, docs = overlay
    kinds = {d["kind"] for d in docs}
    assert {"Namespace", "ConfigMap", "Deployment", "Service"} <= kinds
    assert {"HorizontalPodAutoscaler", "PodDisruptionBudget", "NetworkPolicy"} <= kinds
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CRDS:
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {
        "specsplit"
    }


def test_the_validator_rejects_what_it_should():
    """Guard: strict validation of this version fails on a misspelt field."""
    deployment = dict(find(build("deploy/overlays/cpu"), "Deployment")[0])
    deployment["spec"] = {**deployment["spec"], "replica": 2}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def test_gateway_ports_probes_and_service_match_the_code(overlay):
    _, docs = overlay
    http = GatewaySettings.model_fields["port"].default
    c = container(docs, "gateway")
    assert c["args"] == ["gateway"]
    assert port(c, "http") == http
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["livenessProbe"]["httpGet"]["path"] in {"/health", "/metrics"}
    assert c["startupProbe"]["httpGet"]["port"] == "http"
    routes = {r.path for r in ops.routes}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["path"] in routes
    service = one(docs, "Service", "specsplit-gateway")
    assert [(p["name"], p["port"]) for p in service["spec"]["ports"]] == [("http", http)]
    annotations = one(docs, "Deployment", "specsplit-gateway")["spec"]["template"]["metadata"][
        "annotations"
    ]
    assert annotations["prometheus.io/port"] == str(http)
    assert annotations["prometheus.io/path"] in routes


@pytest.mark.parametrize("role", ROLES)
def test_worker_ports_probes_and_headless_service_match_the_code(overlay, role):
    _, docs = overlay
    options = worker_settings(role).server_options()  # the defaults: gRPC port and + 1000
    c = container(docs, role)
    assert c["args"] == ["worker", role]
    assert port(c, "grpc") == options.port
    assert port(c, "metrics") == options.metrics_port
    assert port(c, "health") == options.health_port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        # grpc.health.v1, service "", on the plaintext health-only port (kubelet cannot TLS)
        assert c[probe]["grpc"]["port"] == options.health_port, probe
    service = one(docs, "Service", f"specsplit-{role}")
    assert service["spec"]["clusterIP"] == "None"  # headless: resolves to every pod
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
        "grpc": options.port,
        "metrics": options.metrics_port,
    }
    pod = one(docs, "Deployment", f"specsplit-{role}")["spec"]["template"]
    assert selects({"matchLabels": service["spec"]["selector"]}, pod["metadata"]["labels"])
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(options.metrics_port)


def test_environment_names_are_settings_and_parse(overlay, monkeypatch):
    """Every SPECSPLIT_ variable is a field of its command's settings, and its value parses."""
    _, docs = overlay
    commands = {"gateway": GatewaySettings, "target": WorkerSettings, "draft": WorkerSettings}
    for component, settings_cls in commands.items():
        env = environment(docs, container(docs, component))
        names = {k for k in env if k.startswith("SPECSPLIT_")}
        fields = {f"SPECSPLIT_{f.upper()}" for f in settings_cls.model_fields}
        assert names - NOT_SETTINGS <= fields, f"{component}: unknown {names - fields}"
        with monkeypatch.context() as m:
            for key, value in env.items():
                m.setenv(key, value)
            settings = (
                settings_cls(role=component) if settings_cls is WorkerSettings else settings_cls()
            )
        for key in names - NOT_SETTINGS:  # each value reached its field (secrets: empty here)
            value = getattr(settings, key.removeprefix("SPECSPLIT_").lower())
            assert value == type(value)(env[key]), f"{component}: {key}={env[key]!r} -> {value!r}"


def test_the_workers_threads_fit_their_cpu_limit(overlay):
    """torch's threads (and the bfloat16 kernel's, which follow them) are set, and no more than
    the container may run at once: unset, torch takes one per core of the node."""
    _, docs = overlay
    for role in ROLES:
        c = container(docs, role)
        threads = int(environment(docs, c)["OMP_NUM_THREADS"])
        limit = str(c["resources"]["limits"]["cpu"])
        cores = int(limit[:-1]) / 1000 if limit.endswith("m") else float(limit)
        assert 1 <= threads <= max(1, cores), f"{role}: {threads} threads for {limit} CPUs"


def test_the_workers_channel_is_mutual_tls_with_a_token_from_one_secret(overlay, monkeypatch):
    _, docs = overlay
    files = {}
    for component in ("gateway", *ROLES):
        c = container(docs, component)
        pod = one(docs, "Deployment", f"specsplit-{component}")["spec"]["template"]["spec"]
        secrets = {v["name"]: v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"] if m["name"] in secrets}
        env = environment(docs, c)
        with monkeypatch.context() as m:
            for key, value in env.items():
                m.setenv(key, value)
            if component == "gateway":
                settings = GatewaySettings()
                paths = [settings.worker_ca, settings.worker_cert, settings.worker_key]
                paths.append(settings.worker_token_file)
                assert not settings.insecure and settings.worker_tls_name  # pods dialled by IP
            else:
                settings = WorkerSettings(role=component)
                paths = [settings.tls_cert, settings.tls_key, settings.tls_client_ca]
                paths.append(settings.token_file)
                assert not settings.insecure
        for path in paths:  # every file set, in a mounted Secret
            assert path is not None, component
            assert str(path.parent) in mounts, f"{component}: {path} is not in a Secret"
            files[path.name] = secrets[mounts[str(path.parent)]]
    assert set(files) == set(FILES)
    assert set(files.values()) == {"specsplit-worker-tls"}


def test_termination_grace_covers_the_drain(overlay, monkeypatch):
    """Kubernetes kills a pod after terminationGracePeriodSeconds, counted from the
    preStop hook: the drain the settings ask for must fit inside it."""
    _, docs = overlay
    for component in ("gateway", *ROLES):
        c = container(docs, component)
        pod = one(docs, "Deployment", f"specsplit-{component}")["spec"]["template"]["spec"]
        with monkeypatch.context() as m:
            for key, value in environment(docs, c).items():
                m.setenv(key, value)
            if component == "gateway":
                drain = GatewaySettings().drain_timeout_s + CUT_GRACE_S
            else:
                settings = WorkerSettings(role=component)
                drain = settings.drain_s + settings.grace_s
        pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
        assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + 5, component


def test_gateway_finds_every_worker_through_the_headless_services(overlay):
    _, docs = overlay
    env = environment(docs, container(docs, "gateway"))
    for role in ROLES:
        (address,) = env[f"SPECSPLIT_{role.upper()}_ADDRESSES"].split(",")
        host, _, grpc_port = address.rpartition(":")
        service = one(docs, "Service", host)  # a name in the gateway's own namespace
        assert service["spec"]["clusterIP"] == "None"
        assert int(grpc_port) == worker_settings(role).server_options().port
    assert float(env["SPECSPLIT_DNS_REFRESH_S"]) > 0  # re-resolved: scaled pods join
    target_env = environment(docs, container(docs, "target"))
    assert env["SPECSPLIT_TARGET_MODEL"] == target_env["SPECSPLIT_MODEL"]


def test_pods_are_locked_down(overlay):
    _, docs = overlay
    for deployment in find(docs, "Deployment"):
        spec = deployment["spec"]["template"]["spec"]
        name = deployment["metadata"]["name"]
        assert spec["enableServiceLinks"] is False, name  # no *_PORT variables in SPECSPLIT_
        assert spec["automountServiceAccountToken"] is False, name
        assert spec["securityContext"]["runAsNonRoot"] is True, name
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert "replicas" not in deployment["spec"], f"{name}: the HPA owns replicas"
        volumes = {v["name"]: v for v in spec["volumes"]}
        for c in spec["containers"]:
            security = c["securityContext"]
            assert security["readOnlyRootFilesystem"] is True, name
            assert security["allowPrivilegeEscalation"] is False, name
            assert security["capabilities"]["drop"] == ["ALL"], name
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][kind]), f"{name} {kind}"
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            cache_dir = environment(docs, c)["SPECSPLIT_MODEL_CACHE"]
            for path in (cache_dir, "/tmp"):  # the only writable places
                assert path in mounts, f"{name}: nothing mounted at {path}"
                assert "emptyDir" in volumes[mounts[path]], name


def test_every_deployment_has_a_budget_and_an_autoscaler(overlay):
    _, docs = overlay
    metrics = exported_metric_names()
    for deployment in find(docs, "Deployment"):
        name = deployment["metadata"]["name"]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert [
            p for p in find(docs, "PodDisruptionBudget") if selects(p["spec"]["selector"], labels)
        ]
        ref = {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
        (hpa,) = [
            h for h in find(docs, "HorizontalPodAutoscaler") if h["spec"]["scaleTargetRef"] == ref
        ]
        assert hpa["apiVersion"] == "autoscaling/v2"
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
        for metric in hpa["spec"]["metrics"]:
            if metric["type"] == "Pods":  # a custom metric: one the workers export
                assert metric["pods"]["metric"]["name"] in metrics, name
        if name != "specsplit-gateway":
            assert [m["type"] for m in hpa["spec"]["metrics"]] == ["Pods"], name


def test_only_the_gateway_reaches_the_workers_grpc_ports(overlay):
    _, docs = overlay
    gateway_labels = one(docs, "Deployment", "specsplit-gateway")["spec"]["template"]["metadata"][
        "labels"
    ]
    for role in ROLES:
        options = worker_settings(role).server_options()
        labels = one(docs, "Deployment", f"specsplit-{role}")["spec"]["template"]["metadata"][
            "labels"
        ]
        policies = [
            p for p in find(docs, "NetworkPolicy") if selects(p["spec"]["podSelector"], labels)
        ]
        assert policies, f"no NetworkPolicy selects the {role} pods"
        reaches_grpc, reaches_metrics = [], []
        for policy in policies:
            assert "Ingress" in policy["spec"]["policyTypes"]
            for rule in policy["spec"].get("ingress", []):
                ports = {p["port"] for p in rule.get("ports", [])}
                peers = rule.get("from")
                assert peers, f"{role}: a rule open to every source"
                if options.port in ports or not ports:
                    reaches_grpc += peers
                if options.metrics_port in ports:
                    reaches_metrics += peers
        assert reaches_grpc and all(
            set(p) == {"podSelector"} and selects(p["podSelector"], gateway_labels)
            for p in reaches_grpc
        ), f"{role} gRPC reachable by {reaches_grpc}"
        assert {"namespaceSelector": {"matchLabels": MONITORING}} in reaches_metrics


def test_servicemonitor_shape():
    """The CRD has no schema here: its basic shape, checked against the Services."""
    docs = build("deploy/overlays/gpu")
    (monitor,) = find(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(monitor) == {"apiVersion", "kind", "metadata", "spec"}
    assert set(monitor["spec"]) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}
    selector = monitor["spec"]["selector"]
    services = [s for s in find(docs, "Service") if selects(selector, s["metadata"]["labels"])]
    assert {s["metadata"]["name"] for s in services} == {
        "specsplit-gateway",
        "specsplit-target",
        "specsplit-draft",
    }
    routes = {r.path for r in ops.routes}
    scraped = set()
    for endpoint in monitor["spec"]["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "scheme"}
        assert endpoint["path"] == "/metrics" and endpoint["path"] in routes
        assert endpoint["interval"].endswith("s")
        for service in services:
            ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
            if endpoint["port"] in ports:
                scraped.add((service["metadata"]["name"], ports[endpoint["port"]]))
    http = GatewaySettings.model_fields["port"].default
    expected = {("specsplit-gateway", http)} | {
        (f"specsplit-{r}", worker_settings(r).server_options().metrics_port) for r in ROLES
    }
    assert scraped == expected
    assert not find(build("deploy/overlays/cpu"), "ServiceMonitor")  # no CRD on kind


def test_cpu_overlay_runs_the_embedded_model():
    docs = build("deploy/overlays/cpu")
    assert environment(docs, container(docs, "target"))["SPECSPLIT_MODEL"] == (
        "smollm2-135m-instruct"
    )
    assert environment(docs, container(docs, "draft"))["SPECSPLIT_MODEL"] in {"ngram", "none"}
    for role in ROLES:  # as `make run`: bfloat16 where the kernel builds, else float32
        assert environment(docs, container(docs, role))["SPECSPLIT_DTYPE"] == "auto"
    for role in ("gateway", *ROLES):
        c = container(docs, role)
        assert environment(docs, c).get("SPECSPLIT_DEVICE", "cpu") == "cpu"
        assert "nvidia.com/gpu" not in c["resources"]["limits"]
        assert c["image"] == "specsplit:0.1.0"


def test_gpu_overlay_runs_a_real_pair_on_gpus():
    docs = build("deploy/overlays/gpu")
    models = {"target": "Qwen/Qwen2.5-7B-Instruct", "draft": "Qwen/Qwen2.5-0.5B-Instruct"}
    for role, model in models.items():
        c = container(docs, role)
        env = environment(docs, c)
        assert (env["SPECSPLIT_MODEL"], env["SPECSPLIT_DEVICE"], env["SPECSPLIT_DTYPE"]) == (
            model,
            "cuda",
            "bfloat16",
        )
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert c["resources"]["requests"]["nvidia.com/gpu"] == 1
        spec = one(docs, "Deployment", f"specsplit-{role}")["spec"]["template"]["spec"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
            "tolerations"
        ]
        assert spec["nodeSelector"]
        assert c["image"].endswith("-cu124")
    gateway_env = environment(docs, container(docs, "gateway"))
    assert gateway_env["SPECSPLIT_TARGET_MODEL"] == models["target"]
    assert "nvidia.com/gpu" not in container(docs, "gateway")["resources"]["limits"]


def test_prometheus_adapter_rules_serve_the_autoscalers_metrics():
    rules = yaml.safe_load((REPO / "deploy/monitoring/prometheus-adapter-rules.yaml").read_text())
    metrics = exported_metric_names()
    served = set()
    for rule in rules["rules"]["custom"]:
        series = rule["seriesQuery"].split("{")[0]
        assert series in metrics, series
        assert rule["resources"]["overrides"] == {
            "namespace": {"resource": "namespace"},
            "pod": {"resource": "pod"},
        }
        assert "<<.LabelMatchers>>" in rule["metricsQuery"]
        served.add(rule["name"]["as"])
    for name in OVERLAYS:
        for hpa in find(build(f"deploy/overlays/{name}"), "HorizontalPodAutoscaler"):
            for metric in hpa["spec"]["metrics"]:
                if metric["type"] == "Pods":
                    assert metric["pods"]["metric"]["name"] in served


def test_grafana_dashboards_configmap_builds():
    (config_map,) = build("grafana")
    assert config_map["kind"] == "ConfigMap"
    assert config_map["metadata"]["labels"] == {"grafana_dashboard": "1"}
    assert set(config_map["data"]) == {p.name for p in (REPO / "grafana/dashboards").glob("*.json")}
    kubernetes_validate.validate(config_map, K8S_VERSION, strict=True)
