"""helm/skred with a real helm binary: lint --strict, template with the bundled etcd, with an
external etcd and with every optional part, kubernetes-validate --strict on each rendering, and
checks of what the chart promises (StatefulSet shape, probes, ini the broker accepts, Secret,
PDB, ServiceMonitor, dashboard, values.yaml documented field by field)."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from broker.config import OPTIONS, load_config

from ._tools import CHART_DIR, REPO_ROOT, helm, run, tool

RELEASE = "rel"
NAMESPACE = "msg"
EXTERNAL_ETCD = "etcd-a.infra:2379,etcd-b.infra:2379"
VARIANTS: dict[str, list[str]] = {
    "default": [],
    # helm --set splits on commas unless escaped.
    "external-etcd": [
        "--set", "etcd.enabled=false",
        "--set", "etcd.endpoints=" + EXTERNAL_ETCD.replace(",", "\\,"),
    ],
    "everything": [
        "--set", "metrics.serviceMonitor.enabled=true",
        "--set", "metrics.grafanaDashboard.enabled=true",
        "--set", "podAntiAffinity=hard",
        "--set", "auth.password=fixed-password",
        "--set", "clustering.hooks.onLeaderLost=",
        "--set", "config.extra.amqp.channel_max=256",
        "--set", "tls.enabled=true", "--set", "tls.secretName=skred-tls", "--set", "tls.verifyPeer=true",
    ],
}

_rendered: dict[str, str] = {}


def render(variant: str) -> str:
    if variant not in _rendered:
        argv = [helm(), "template", RELEASE, str(CHART_DIR), "--namespace", NAMESPACE, *VARIANTS[variant]]
        _rendered[variant] = run(argv).stdout
    return _rendered[variant]


def objects(variant: str) -> dict[tuple[str, str], dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(render(variant)) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def pod_specs(variant: str) -> list[tuple[str, dict[str, Any]]]:
    """(object name, pod spec) of every workload in a rendering."""
    found = []
    for (kind, name), obj in objects(variant).items():
        if kind in ("StatefulSet", "Deployment", "DaemonSet", "Job"):
            found.append((name, obj["spec"]["template"]["spec"]))
        elif kind == "Pod":
            found.append((name, obj["spec"]))
    return found


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_no_pod_binds_a_port_of_its_node(variant: str) -> None:
    # Clients reach the pods through the Services; a hostPort (or the node's network) would fail
    # whenever another process on the Kubernetes node holds 5672 or 15672.
    specs = pod_specs(variant)
    assert specs
    for name, spec in specs:
        assert not spec.get("hostNetwork"), name
        for container in [*spec.get("initContainers", []), *spec["containers"]]:
            for port in container.get("ports", []):
                assert "hostPort" not in port and "hostIP" not in port, f"{name}: {port}"


def test_helm_lint_strict() -> None:
    run([helm(), "lint", "--strict", str(CHART_DIR)])
    run([helm(), "lint", "--strict", str(CHART_DIR), *VARIANTS["external-etcd"]])


def test_external_etcd_without_endpoints_is_refused() -> None:
    proc = run([helm(), "template", RELEASE, str(CHART_DIR), "--set", "etcd.enabled=false"], check=False)
    assert proc.returncode != 0 and "etcd.endpoints is required" in proc.stderr


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rendered_manifests_validate_strictly(variant: str, tmp_path: Path) -> None:
    exe = tool("kubernetes-validate", "pip install kubernetes-validate")
    manifest = tmp_path / f"{variant}.yaml"
    manifest.write_text(render(variant))
    proc = run([exe, "--strict", "--quiet", str(manifest)])
    # kubernetes-validate has no schema for CRDs (ServiceMonitor): that is its only allowed warning.
    for line in (proc.stdout + proc.stderr).splitlines():
        assert "ServiceMonitor" in line or not line.strip(), line


def test_kubernetes_validate_rejects_an_unknown_field(tmp_path: Path) -> None:
    exe = tool("kubernetes-validate", "pip install kubernetes-validate")
    statefulset = objects("default")[("StatefulSet", "rel-skred")]
    statefulset["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["bogus"] = 1
    manifest = tmp_path / "bad.yaml"
    manifest.write_text(yaml.safe_dump(statefulset))
    assert run([exe, "--strict", "--quiet", str(manifest)], check=False).returncode != 0


def test_statefulset_shape() -> None:
    sts = objects("default")[("StatefulSet", "rel-skred")]
    spec = sts["spec"]
    assert spec["replicas"] == 3
    assert spec["podManagementPolicy"] == "Parallel"
    assert spec["serviceName"] == "rel-skred-headless"
    assert spec["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    pod = spec["template"]["spec"]
    container = pod["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert probe in container, probe
    # The image's health command (skredctl aliveness, as its HEALTHCHECK) on the management port.
    assert container["readinessProbe"]["exec"]["command"] == [
        "skredctl", "--url=http://127.0.0.1:15672", "aliveness"]
    assert container["resources"]["requests"] and container["resources"]["limits"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert "preferredDuringSchedulingIgnoredDuringExecution" in pod["affinity"]["podAntiAffinity"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["data"] == "/var/lib/skred"
    env = {e["name"]: e for e in container["env"]}
    assert env["SKRED_MAIN_DEFAULT_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "rel-skred"
    assert env["SKRED_CLUSTERING_ADVERTISED_URI"]["value"] == (
        "tcp://$(POD_NAME).rel-skred-headless.msg.svc.cluster.local:5679"
    )
    hard = objects("everything")[("StatefulSet", "rel-skred")]["spec"]["template"]["spec"]["affinity"]
    assert "requiredDuringSchedulingIgnoredDuringExecution" in hard["podAntiAffinity"]


def test_services_headless_and_client() -> None:
    objs = objects("default")
    headless = objs[("Service", "rel-skred-headless")]["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is True
    assert {p["name"] for p in headless["ports"]} >= {"amqp", "http", "metrics", "replication"}
    client = objs[("Service", "rel-skred")]["spec"]
    assert {p["name"] for p in client["ports"]} == {"amqp", "http", "metrics"}


def ini_text(variant: str) -> str:
    return str(objects(variant)[("ConfigMap", "rel-skred")]["data"]["skred.ini"])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_broker_accepts_the_rendered_ini(variant: str, tmp_path: Path) -> None:
    ini = tmp_path / "skred.ini"
    ini.write_text(ini_text(variant))
    config = load_config(["-c", str(ini)], environ={})
    assert config.clustering.enabled
    assert str(config.main.data_dir) == "/var/lib/skred"
    # Every listener, including any added later, must listen on the pod network.
    for option in OPTIONS:
        if option.name == "bind" or option.name.endswith("_bind"):
            assert getattr(getattr(config, option.section), option.name) == "0.0.0.0", option.key
    assert config.clustering.etcd_prefix == "rel-skred"
    if variant == "external-etcd":
        assert config.clustering.etcd_endpoints == EXTERNAL_ETCD
        assert not any(kind == "StatefulSet" and "etcd" in name for kind, name in objects(variant))
    else:
        assert config.clustering.etcd_endpoints == "rel-skred-etcd.msg.svc.cluster.local:2379"
        assert ("Service", "rel-skred-etcd") in objects(variant)
    if variant == "everything":
        assert config.amqp.channel_max == 256
        assert config.clustering.on_leader_lost == ""
        # TLS: the certificate files come from the Secret, mounted where the ini points
        assert (config.main.tls_cert, config.main.tls_key, config.main.tls_ca_cert) == (
            "/etc/skred/tls/tls.crt", "/etc/skred/tls/tls.key", "/etc/skred/tls/ca.crt")
        assert config.main.tls_verify_peer and (config.amqp.tls_port, config.mgmt.tls_port) == (5671, 15671)
        pod = objects(variant)[("StatefulSet", "rel-skred")]["spec"]["template"]["spec"]
        assert {"name": "tls", "secret": {"secretName": "skred-tls", "defaultMode": 0o440}} in pod["volumes"]
        mounts = pod["containers"][0]["volumeMounts"]
        assert {"name": "tls", "mountPath": "/etc/skred/tls", "readOnly": True} in mounts
        client = objects(variant)[("Service", "rel-skred")]["spec"]["ports"]
        assert {p["name"] for p in client} >= {"amqps", "https"}
    else:
        assert not config.main.tls_cert


def test_hook_scripts_in_the_configmap_are_valid_shell(tmp_path: Path) -> None:
    data = objects("default")[("ConfigMap", "rel-skred")]["data"]
    ini = ini_text("default")
    for key in ("on-leader-elected.sh", "on-leader-lost.sh"):
        assert f"/etc/skred/hooks/{key}" in ini
        script = tmp_path / key
        script.write_text(data[key])
        run(["sh", "-n", str(script)])


def test_bundled_etcd_forms_a_static_cluster() -> None:
    etcd = objects("default")[("StatefulSet", "rel-skred-etcd")]
    assert etcd["spec"]["replicas"] == 3 and etcd["spec"]["podManagementPolicy"] == "Parallel"
    command = etcd["spec"]["template"]["spec"]["containers"][0]["command"]
    initial = next(a for a in command if a.startswith("--initial-cluster="))
    members = initial.split("=", 1)[1].split(",")
    assert [m.split("=")[0] for m in members] == [f"rel-skred-etcd-{i}" for i in range(3)]
    assert all(m.endswith(".rel-skred-etcd-headless.msg.svc.cluster.local:2380") for m in members)


def test_secret_holds_the_default_user() -> None:
    secret = objects("everything")[("Secret", "rel-skred")]
    assert base64.b64decode(secret["data"]["username"]) == b"admin"
    assert base64.b64decode(secret["data"]["password"]) == b"fixed-password"
    generated = base64.b64decode(objects("default")[("Secret", "rel-skred")]["data"]["password"])
    assert len(generated) >= 16


def test_pod_disruption_budgets() -> None:
    objs = objects("default")
    assert objs[("PodDisruptionBudget", "rel-skred")]["spec"]["maxUnavailable"] == 1
    assert objs[("PodDisruptionBudget", "rel-skred-etcd")]["spec"]["maxUnavailable"] == 1


def test_optional_monitoring_objects() -> None:
    assert not any(kind == "ServiceMonitor" for kind, _ in objects("default"))
    objs = objects("everything")
    monitor = objs[("ServiceMonitor", "rel-skred")]
    headless_labels = objs[("Service", "rel-skred-headless")]["metadata"]["labels"]
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert all(headless_labels.get(k) == v for k, v in selector.items()), "must select the headless Service"
    client_labels = objs[("Service", "rel-skred")]["metadata"]["labels"]
    assert not all(client_labels.get(k) == v for k, v in selector.items()), "would scrape pods twice"
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    dashboard_cm = objs[("ConfigMap", "rel-skred-dashboard")]
    assert dashboard_cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(dashboard_cm["data"]["skred-dashboard.json"])
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert any("skred_queue_messages_ready" in e for e in exprs)


def test_values_yaml_is_documented_field_by_field() -> None:
    """Every key has a comment line right above it, unless an enclosing key carries a "# --"
    comment describing its whole value (e.g. resources: requests/limits)."""
    lines = (CHART_DIR / "values.yaml").read_text().splitlines()
    ancestors: list[tuple[int, bool]] = []  # (indent, documented with "# --") of enclosing keys
    undocumented = []
    for i, line in enumerate(lines):
        match = re.match(r"^(\s*)([A-Za-z_][A-Za-z0-9_]*):", line)
        if not match:
            continue
        indent = len(match.group(1))
        while ancestors and ancestors[-1][0] >= indent:
            ancestors.pop()
        first = i  # first line of the comment block right above the key
        while first > 0 and lines[first - 1].strip().startswith("#"):
            first -= 1
        if first == i and not any(doc for _, doc in ancestors):
            undocumented.append(f"line {i + 1}: {line.strip()}")
        ancestors.append((indent, first < i and lines[first].strip().startswith("# --")))
    assert not undocumented, "values.yaml keys without a comment:\n" + "\n".join(undocumented)
    assert yaml.safe_load("\n".join(lines))["replicaCount"] == 3


# Cluster metrics named by the design (section 7) and emitted by the cluster layer.
DESIGN_CLUSTER_METRICS = {"skred_is_leader", "skred_connected_followers", "skred_follower_lag_in_bytes"}


def broker_metric_names() -> set[str]:
    """Metric names broker/metrics.py exposes: _g("x") -> skred_x, _c("x") -> skred_x_total."""
    source = (REPO_ROOT / "broker" / "metrics.py").read_text()
    names = {f"skred_{n}" for n in re.findall(r'\b_g\(\s*"(\w+)"', source)}
    names |= {f"skred_{n}_total" for n in re.findall(r'\b_c\(\s*"(\w+)"', source)}
    return names


def test_dashboard_queries_metrics_that_exist() -> None:
    dashboard = json.loads((CHART_DIR / "files" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {name for e in exprs for name in re.findall(r"\bskred_\w+", e)}
    known = broker_metric_names()
    assert {"skred_connections", "skred_queue_messages_ready"} <= known, "metric parser found nothing"
    unknown = used - known - DESIGN_CLUSTER_METRICS
    assert not unknown, f"dashboard queries metrics the broker does not expose: {sorted(unknown)}"


def test_a_numeric_image_tag_renders_as_written() -> None:
    # `--set image.tag=2024` makes the value an integer; the image reference must still be "repo:2024".
    argv = [helm(), "template", RELEASE, str(CHART_DIR), "--set", "image.repository=reg/skred",
            "--set", "image.tag=2024", "--show-only", "templates/statefulset.yaml"]
    sts = yaml.safe_load(run(argv).stdout)
    assert sts["spec"]["template"]["spec"]["containers"][0]["image"] == "reg/skred:2024"
