"""The Dockerfile, checked without a Docker engine: its instructions, its environment
against the broker's option list, and its HEALTHCHECK command run for real against a
local broker (healthy when the aliveness API answers, unhealthy when nothing listens)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from integration._support import stop_group

from broker.config import OPTIONS

from ._tools import DOCKERFILE, REPO_ROOT, dockerfile_env, free_port, listener_ports_env, poll

OPTIONS_BY_ENV = {option.env: option for option in OPTIONS}


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    lines = [line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")]
    text = "\n".join(lines).replace("\\\n", " ")
    result = []
    for line in text.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            result.append((word.upper(), rest.strip()))
    return result


def only(name: str) -> str:
    found = [args for word, args in instructions() if word == name]
    assert len(found) == 1, f"expected one {name}, found {found}"
    return found[0]


def healthcheck_argv() -> list[str]:
    args = only("HEALTHCHECK")
    _, _, command = args.partition("CMD ")
    argv = json.loads(command)
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv)
    return argv


def test_base_image_user_entrypoint_volume_and_ports() -> None:
    # The base is an ARG (CI builds on a local Debian image); its default is the official slim image.
    assert only("FROM") == "${BASE_IMAGE}"
    assert any(word == "ARG" and args == "BASE_IMAGE=python:3.11-slim" for word, args in instructions())
    user = only("USER").split(":")[0]
    assert user not in ("root", "0"), "the broker must not run as root"
    assert json.loads(only("ENTRYPOINT")) == ["skred"]
    assert json.loads(only("VOLUME")) == ["/var/lib/skred"]
    exposed = {port for _, args in instructions() if _ == "EXPOSE" for port in args.split()}
    assert exposed == {"5672", "15672", "15692", "5679", "1883", "5552"}
    assert any(word == "RUN" and "pip install ." in args for word, args in instructions())


def test_environment_names_real_options() -> None:
    env = dockerfile_env()
    assert env["SKRED_MAIN_DATA_DIR"] == "/var/lib/skred"
    for key, value in env.items():
        if key.startswith("SKRED_"):
            assert key in OPTIONS_BY_ENV, f"{key} is not a Skred option"
            OPTIONS_BY_ENV[key].parse(value)


def test_dockerignore_keeps_what_pip_install_needs() -> None:
    # The context holds only what the Dockerfile copies; each COPY source must survive .dockerignore.
    rules = [r.strip() for r in (REPO_ROOT / ".dockerignore").read_text().splitlines()]
    allowed = {r[1:].rstrip("/") for r in rules if r.startswith("!")}
    assert "*" in rules
    for word, args in instructions():
        if word == "COPY":
            for source in args.split()[:-1]:
                assert source.rstrip("/") in allowed, f"COPY {source} is excluded by .dockerignore"
                assert (REPO_ROOT / source).exists()


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, dict[str, str]]]:
    """A single local broker with the image's default user settings; yields (mgmt port, env).
    Module-scoped: the healthcheck tests only read it (one boot instead of one per test)."""
    tmp_path = tmp_path_factory.mktemp("healthcheck-broker")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKRED_")}
    env.update(
        listener_ports_env(),
        PYTHONPATH=str(REPO_ROOT),
        SKRED_MAIN_DATA_DIR=str(tmp_path / "data"),
        SKRED_MAIN_DEFAULT_USER="healthcheck-user",
        SKRED_MAIN_DEFAULT_PASSWORD="s3cret",
        SKRED_MAIN_WORKERS="1",
    )
    mgmt_port = int(env["SKRED_MGMT_PORT"])
    log = open(tmp_path / "broker.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "broker"], env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield mgmt_port, env
    finally:
        stop_group(proc, 15)
        log.close()


def run_healthcheck(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    argv = healthcheck_argv()
    assert argv[0] == "skredctl", "the health command ships with the broker (the slim image has no curl)"
    return subprocess.run([sys.executable, "-m", "broker.ctl", *argv[1:]], env=env, capture_output=True,
                          text=True, timeout=10)


def healthy(env: dict[str, str]) -> bool:
    """The HEALTHCHECK command passed; a run cut off by its 10 s timeout (a loaded machine, a
    broker still booting) is a "not yet" for the deadline of the poll, as for the engine."""
    try:
        return run_healthcheck(env).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def test_healthcheck_passes_against_a_live_broker(broker: tuple[int, dict[str, str]]) -> None:
    _, env = broker
    poll(lambda: healthy(env), 60.0, "the HEALTHCHECK command to succeed")


def test_healthcheck_fails_with_wrong_credentials(broker: tuple[int, dict[str, str]]) -> None:
    _, env = broker
    poll(lambda: healthy(env), 60.0, "the HEALTHCHECK command to succeed")
    assert run_healthcheck({**env, "SKRED_MAIN_DEFAULT_PASSWORD": "wrong"}).returncode != 0


def test_healthcheck_fails_when_nothing_listens() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKREDCTL_")}
    env["SKRED_MGMT_PORT"] = str(free_port())
    failed = run_healthcheck(env)
    assert failed.returncode == 1, failed  # a healthcheck's one failure status (2 is reserved)
    assert "cannot connect" in failed.stderr


def test_healthcheck_is_plain_words() -> None:
    # No shell, no quoting, no argument with spaces: an engine that splits the command into
    # words (podman's Docker API for docker-compose) runs exactly this.
    argv = healthcheck_argv()
    assert all(arg and not any(c.isspace() for c in arg) for arg in argv), argv
