"""The Helm chart's pod, started for real: ``podman kube play`` on the rendered pod template.

Theory of operation: ``helm template`` renders the chart (one replica, external etcd at
127.0.0.1:2379, the session's image built from the Dockerfile by tests/deploy/conftest.py).
Kubernetes itself is not available, so the test turns the rendering into what ``podman kube play``
runs, each change an explicit rule:

* the StatefulSet becomes its first Pod (``<name>-0``) with the template's spec unchanged
  (image, args, env, ports, probes, security contexts, ConfigMap volumes);
* ``secretKeyRef`` env values are replaced by the values in the rendered Secret, and
  ``$(VAR)`` references to earlier variables expanded as Kubernetes does (podman 4.3 does not;
  ``fieldRef: metadata.name`` gives the pod name);
* the ``data`` volumeClaimTemplate becomes a hostPath dir owned by the pod's fsGroup user;
* the ``tmp`` emptyDir becomes a hostPath dir too (podman's emptyDir support varies);
* an etcd container (``ETCD_IMAGE``) joins the pod, standing in for the etcd Service: the pod
  shares one network namespace, so 127.0.0.1:2379 reaches it;
* every container port gets a free host port on 127.0.0.1 (the test connects to AMQP's): podman
  4.3 publishes a ``containerPort`` without ``hostPort`` on the same host port (15672, 5679, ...)
  on every address, which Kubernetes never does, and which fails whenever another process
  holds one of them. While the pod runs, the test holds each of the chart's container port
  numbers itself, and the pod must publish exactly the host ports picked here;
* the pod's annotations (config checksums that roll the StatefulSet) are dropped: podman 4.3
  wrongly applies the 63-character label-value limit to annotations.

Then the pod must serve: the startup and liveness probes (tcpSocket) connect, the readiness
probe's command (run inside the container with ``podman exec``) exits 0, and the chart's
default user from the Secret publishes and reads a persistent message. A chart whose pod
cannot start a node fails here.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import os
import re
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from ._engine import UP_TIMEOUT, confirmed_round_trip
from ._tools import CHART_DIR, free_port, helm, poll, run, tool

pytestmark = pytest.mark.timeout(UP_TIMEOUT + 180)

RELEASE = "kubeplay"
PASSWORD = "kube-play-secret"
READY_DEADLINE = 120.0  # seconds for the pod's node to win the election and serve


@dataclass
class Pod:
    name: str
    container: str
    spec: dict[str, Any]
    amqp_port: int
    secret: dict[str, str]
    host_ports: dict[str, int]  # port name -> the free host port the test picked for it


def podman(*args: str, timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    exe = tool("podman", "apt-get install podman (see .ci/run)")
    proc = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        pytest.fail(f"podman {' '.join(args[:3])} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


def kube_manifest(rendered: str, data_dir: Path, tmp_dir: Path
                  ) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, str]]:
    """(documents for podman kube play, the pod, the Secret's decoded data) per the rules above."""
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    secret = next(d for d in docs if d["kind"] == "Secret")
    secret_data = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    secret_data.update(secret.get("stringData") or {})
    sts = next(d for d in docs if d["kind"] == "StatefulSet")
    template = copy.deepcopy(sts["spec"]["template"])
    spec = template["spec"]
    (container,) = spec["containers"]
    pod_name = f"{sts['metadata']['name']}-0"
    known: dict[str, str] = {}
    for env in container["env"]:
        ref = env.get("valueFrom", {}).get("secretKeyRef")
        if ref is not None:
            assert ref["name"] == secret["metadata"]["name"], f"env {env['name']} names another Secret"
            env.pop("valueFrom")
            env["value"] = secret_data[ref["key"]]
        field = env.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        if field == "metadata.name":
            known[env["name"]] = pod_name
        if "value" in env:
            env["value"] = re.sub(r"\$\((\w+)\)", lambda m: known.get(m.group(1), m.group(0)), env["value"])
            known[env["name"]] = env["value"]
    for port in container["ports"]:
        assert "hostPort" not in port, f"the chart binds a host port: {port}"
        port.update(hostPort=free_port(), hostIP="127.0.0.1")
    for volume in spec["volumes"]:
        if volume["name"] == "tmp":
            volume.pop("emptyDir")
            volume["hostPath"] = {"path": str(tmp_dir), "type": "Directory"}
    claims = [c["metadata"]["name"] for c in sts["spec"].get("volumeClaimTemplates", [])]
    assert claims == ["data"]
    spec["volumes"].append({"name": "data", "hostPath": {"path": str(data_dir), "type": "Directory"}})
    spec["containers"].append({
        "name": "etcd", "image": os.environ.get("ETCD_IMAGE", "quay.io/coreos/etcd:v3.5.17"),
        "command": ["etcd", "--data-dir=/tmp/etcd", "--listen-client-urls=http://127.0.0.1:2379",
                    "--advertise-client-urls=http://127.0.0.1:2379",
                    "--listen-peer-urls=http://127.0.0.1:2380"],
    })
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": pod_name, "labels": template["metadata"]["labels"]},
           "spec": spec}
    configmaps = [d for d in docs if d["kind"] == "ConfigMap"]
    return [*configmaps, pod], pod, secret_data


@pytest.fixture(scope="module")
def pod(tmp_path_factory: pytest.TempPathFactory, skred_image: str) -> Iterator[Pod]:
    repository, _, image_tag = skred_image.rpartition(":")
    rendered = run([helm(), "template", RELEASE, str(CHART_DIR), "--namespace", "default",
                    "--set", "replicaCount=1", "--set", "etcd.enabled=false",
                    "--set", "etcd.endpoints=127.0.0.1:2379", "--set", f"auth.password={PASSWORD}",
                    "--set", f"image.repository={repository}", "--set", f"image.tag={image_tag}"]).stdout
    work = tmp_path_factory.mktemp("kube-play")
    data_dir, tmp_dir = work / "data", work / "tmp"
    for directory in (data_dir, tmp_dir):
        directory.mkdir()
        os.chown(directory, 10001, 10001)  # what fsGroup/the PVC provisioner do in Kubernetes
    # The host ports are picked after the build: picked before, one may be taken by the time it binds.
    docs, pod_doc, secret = kube_manifest(rendered, data_dir, tmp_dir)
    manifest = work / "pod.yaml"
    manifest.write_text(yaml.safe_dump_all(docs))
    name = pod_doc["metadata"]["name"]
    container = pod_doc["spec"]["containers"][0]
    host_ports = {p["name"]: p["hostPort"] for p in container["ports"]}
    configmaps = [d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"]
    podman("volume", "rm", "-f", *configmaps, check=False)  # left by a run that was killed
    held = [p["containerPort"] for c in pod_doc["spec"]["containers"] for p in c.get("ports", [])]
    try:
        with holding(held):  # another process on 15672 & co. must not matter
            podman("kube", "play", str(manifest), timeout=UP_TIMEOUT)
            yield Pod(name, f"{name}-{container['name']}", container, host_ports["amqp"], secret, host_ports)
    finally:
        logs = podman("logs", f"{name}-{container['name']}", check=False).stderr
        (work / "skred.log").write_text(logs)
        print(f"kube play pod log: {work / 'skred.log'}")
        podman("pod", "rm", "-f", name, check=False)
        # podman kube play leaves a volume named after each ConfigMap behind: remove it with the pod.
        podman("volume", "rm", "-f", *configmaps, check=False)


@contextlib.contextmanager
def holding(ports: list[int]) -> Iterator[None]:
    """Listen on each port on all addresses, as another process would (one held already is fine)."""
    with contextlib.ExitStack() as stack:
        for port in ports:
            sock = stack.enter_context(socket.socket())
            try:
                sock.bind(("0.0.0.0", port))
            except OSError:
                continue  # somebody else holds it: just as good
            sock.listen()
        yield


def published(pod: Pod) -> set[tuple[str, int]]:
    """(host address, host port) of every port the pod publishes, as podman reports them."""
    out = podman("port", pod.container).stdout
    found = set()
    for line in out.splitlines():  # "5672/tcp -> 127.0.0.1:40123"
        _, _, host = line.partition(" -> ")
        address, _, port = host.rpartition(":")
        found.add((address, int(port)))
    return found


def connects(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError:
        return False
    return True


def running(pod: Pod) -> bool:
    state = podman("inspect", "--format", "{{.State.Status}}", pod.container, check=False).stdout.strip()
    assert state in ("running", "created", "configured", "initialized"), (
        f"the chart's skred container is {state!r}:\n"
        + podman("logs", pod.container, check=False).stderr[-3000:])
    return state == "running"


def test_probes_pass(pod: Pod) -> None:
    poll(lambda: running(pod), READY_DEADLINE, "the skred container to run", 1.0)
    for probe in ("startupProbe", "livenessProbe"):
        assert pod.spec[probe]["tcpSocket"]["port"] == "amqp"
        poll(lambda: connects(pod.amqp_port), READY_DEADLINE, f"the {probe} (tcpSocket amqp)", 1.0)
    command = pod.spec["readinessProbe"]["exec"]["command"]
    poll(lambda: podman("exec", pod.container, *command, check=False).returncode == 0,
         READY_DEADLINE, "the readinessProbe command to exit 0 inside the container", 2.0)
    assert running(pod)


def test_publishes_only_the_free_ports_it_was_given(pod: Pod) -> None:
    poll(lambda: running(pod), READY_DEADLINE, "the skred container to run", 1.0)
    assert published(pod) == {("127.0.0.1", port) for port in pod.host_ports.values()}


def test_the_node_advertises_its_stable_dns_name(pod: Pod) -> None:
    poll(lambda: running(pod), READY_DEADLINE, "the skred container to run", 1.0)
    log = podman("logs", pod.container, check=False).stderr
    assert f"tcp://{pod.name}.{RELEASE}-skred-headless.default.svc.cluster.local:5679" in log, log[-2000:]


def test_the_secrets_user_publishes_and_reads(pod: Pod) -> None:
    assert pod.secret["password"] == PASSWORD
    body = confirmed_round_trip(pod.amqp_port, pod.secret["username"], pod.secret["password"],
                                "kube-play", b"from the chart")
    assert body == b"from the chart"
