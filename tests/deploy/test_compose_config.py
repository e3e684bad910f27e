"""deploy/docker-compose.yml: valid for docker-compose and the Compose Specification, and
shaped as documented (one etcd, three clustered nodes, loopback-only distinct host ports,
own volumes, healthchecks, depends_on conditions, hooks, Prometheus profile)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from broker.config import OPTIONS

from ._tools import (
    COMPOSE_FILE,
    DEPLOY_DIR,
    REPO_ROOT,
    compose_file,
    dockerfile_env,
    interpolate,
    run,
    service_env,
    tool,
)
from .test_dockerfile import healthcheck_argv

OPTIONS_BY_ENV = {option.env: option for option in OPTIONS}


def skred_nodes(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: svc
        for name, svc in data["services"].items()
        if service_env(svc).get("SKRED_CLUSTERING_ENABLED", "").lower() == "true"
    }


def test_docker_compose_config_accepts_the_file() -> None:
    exe = tool("docker-compose", "apt-get install docker-compose")
    run([exe, "-f", str(COMPOSE_FILE), "config", "-q"])
    run([exe, "-f", str(COMPOSE_FILE), "--profile", "monitoring", "config", "-q"])


def test_docker_compose_config_rejects_a_broken_file(tmp_path: Any) -> None:
    # The validator must be able to fail: a service with an unknown key is rejected.
    exe = tool("docker-compose", "apt-get install docker-compose")
    broken = tmp_path / "docker-compose.yml"
    broken.write_text("services:\n  a:\n    image: x\n    no_such_key: 1\n")
    assert run([exe, "-f", str(broken), "config", "-q"], check=False).returncode != 0


def test_compose_spec_schema() -> None:
    exe = tool("check-jsonschema", "pip install check-jsonschema")
    run([exe, "--builtin-schema", "vendor.compose-spec", str(COMPOSE_FILE)])


def test_one_etcd_and_three_clustered_nodes() -> None:
    data = compose_file()
    nodes = skred_nodes(data)
    assert sorted(nodes) == ["skred-1", "skred-2", "skred-3"]
    assert "etcd" in data["services"]
    for name, svc in nodes.items():
        env = service_env(svc)
        assert env["SKRED_CLUSTERING_ADVERTISED_URI"] == f"tcp://{name}:5679"
        assert env["SKRED_CLUSTERING_ETCD_ENDPOINTS"] == "etcd:2379"
        for listener in ("SKRED_AMQP_BIND", "SKRED_MGMT_BIND", "SKRED_CLUSTERING_BIND"):
            assert env[listener] == "0.0.0.0", f"{name}: {listener} must listen on the container network"
        assert env["SKRED_MAIN_DEFAULT_USER"] != "guest", "guest may only log in from loopback"
        assert svc["depends_on"]["etcd"]["condition"] == "service_healthy"
        # One health command for the image and the compose file: skredctl's aliveness test.
        assert svc["healthcheck"]["test"] == ["CMD", *healthcheck_argv()], name
    assert data["services"]["etcd"]["healthcheck"]["test"]


def podman_compat_healthcheck(test: list[str]) -> list[str]:
    """The healthcheck podman 4's Docker-compatible API stores for a create request's ``test``.

    The compat handler joins the list with spaces into one CLI string; a ``CMD`` string is then
    split again on whitespace (so an argument with spaces falls apart into words), while a
    ``CMD-SHELL`` string is split once, after its first word, and keeps its command whole.
    docker-compose 1.29 sends the list as written; Docker itself stores it unchanged.
    """
    joined = " ".join(test)
    if test[0].upper() == "CMD-SHELL":
        return joined.split(" ", 1)
    return joined.split()


def test_every_service_has_a_healthcheck_podman_runs_as_written() -> None:
    # The class of bug: a healthcheck that is correct in Docker but arrives in podman split into
    # words (`python -c "<script with spaces>"` became `python -c import ...`: unhealthy forever).
    # tests/deploy/test_compose_docker.py runs them for real and waits for every service healthy.
    for name, svc in compose_file()["services"].items():
        assert "healthcheck" in svc, f"{name} has no healthcheck: 'healthy' could not be asserted"
        test = svc["healthcheck"]["test"]
        assert isinstance(test, list) and test[0] in ("CMD", "CMD-SHELL"), f"{name}: {test!r}"
        assert podman_compat_healthcheck(test) == test, f"{name}: podman would run {test!r} split into words"


def test_every_skred_variable_is_a_real_option_with_a_valid_value() -> None:
    for name, svc in skred_nodes(compose_file()).items():
        for key, value in service_env(svc).items():
            if not key.startswith("SKRED_"):
                continue
            assert key in OPTIONS_BY_ENV, f"{name}: {key} is not a Skred option"
            OPTIONS_BY_ENV[key].parse(value)  # raises ValueError on a bad value


def test_ports_are_loopback_only_and_distinct() -> None:
    data = compose_file()
    seen: dict[int, str] = {}
    for name, svc in data["services"].items():
        for spec in svc.get("ports", []):
            host_ip, host_port, container_port = interpolate(str(spec), {}).split(":")
            assert host_ip == "127.0.0.1", f"{name} publishes {spec} beyond loopback"
            assert int(host_port) not in seen, f"{name} and {seen.get(int(host_port))} share {host_port}"
            seen[int(host_port)] = name
    for name, svc in skred_nodes(data).items():
        published = {str(p).rsplit(":", 1)[1] for p in svc["ports"]}
        assert published == {"5672", "5671", "15672", "15671", "15692"}, name  # TLS ports: docs/tls.md


def test_each_node_has_its_own_data_volume_and_the_hooks() -> None:
    data = compose_file()
    volumes_used: set[str] = set()
    for name, svc in skred_nodes(data).items():
        env = service_env(svc)
        mounts = {str(v).split(":")[1]: str(v).split(":")[0] for v in svc["volumes"]}
        data_volume = mounts[env["SKRED_MAIN_DATA_DIR"]]
        assert data_volume in data["volumes"], f"{name}: data dir must be a named volume"
        assert data_volume not in volumes_used, f"{name} shares a data volume"
        volumes_used.add(data_volume)
        hooks_dir = DEPLOY_DIR / mounts["/etc/skred/hooks"]
        for key in ("SKRED_CLUSTERING_ON_LEADER_ELECTED", "SKRED_CLUSTERING_ON_LEADER_LOST"):
            script = env[key].split()[-1]
            assert script.startswith("/etc/skred/hooks/")
            assert (hooks_dir / script.rsplit("/", 1)[1]).is_file(), f"{key} names a missing script"


def test_prometheus_is_optional_and_scrapes_every_node() -> None:
    data = compose_file()
    prometheus = data["services"]["prometheus"]
    assert prometheus["profiles"] == ["monitoring"]
    config_mount = next(v for v in prometheus["volumes"] if "prometheus.yml" in v)
    config = yaml.safe_load((DEPLOY_DIR / config_mount.split(":")[0]).read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == {f"{name}:15692" for name in skred_nodes(data)}


def test_build_context_is_the_repository() -> None:
    for svc in skred_nodes(compose_file()).values():
        context = (DEPLOY_DIR / svc["build"]["context"]).resolve()
        assert context == REPO_ROOT
        assert (context / svc["build"]["dockerfile"]).is_file()


@pytest.mark.parametrize("script", ["on-leader-elected.sh", "on-leader-lost.sh"])
def test_hook_scripts_are_valid_shell(script: str) -> None:
    run(["sh", "-n", str(DEPLOY_DIR / "hooks" / script)])


def test_every_listener_binds_all_interfaces_in_the_container() -> None:
    # Derived from the option list, so a listener added later is caught here.
    binds = [option.env for option in OPTIONS if option.name == "bind" or option.name.endswith("_bind")]
    assert binds
    image_env = dockerfile_env()
    for name, svc in skred_nodes(compose_file()).items():
        container_env = {**image_env, **service_env(svc)}
        for key in binds:
            assert container_env.get(key) == "0.0.0.0", f"{name}: {key} is {container_env.get(key)!r}"
