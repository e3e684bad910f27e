"""What ``pip install .`` gives: a node that can cluster (the etcd client is a core dependency);
a LICENSE file that says what pyproject.toml says; a systemd unit that starts and reloads it."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from broker.config import load_config

from ._tools import REPO_ROOT

PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())


def requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[ ;<>=!~\[]", req, maxsplit=1)[0].lower() for req in requirements}


def test_the_etcd_client_is_a_core_dependency() -> None:
    # Docker compose, Helm and the README's local cluster all enable clustering after `pip install .`.
    assert "aetcd" in requirement_names(PYPROJECT["project"]["dependencies"])


def test_license_file_is_the_license_pyproject_names() -> None:
    assert PYPROJECT["project"]["license"] == {"text": "Apache-2.0"}
    text = (REPO_ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the whole licence, not a stub


def unit() -> dict[str, dict[str, str]]:
    sections: dict[str, dict[str, str]] = {}
    current: dict[str, str] = {}
    for line in (REPO_ROOT / "deploy" / "skred.service").read_text().splitlines():
        line = line.strip()
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
        elif line and not line.startswith("#"):
            key, _, value = line.partition("=")
            current[key] = value
    return sections


def test_systemd_unit_starts_skred_with_options_it_accepts(tmp_path: Path) -> None:
    service = unit()["Service"]
    argv = shlex.split(service["ExecStart"])
    assert Path(argv[0]).name == "skred"
    ini = tmp_path / "skred.ini"
    ini.write_text("")
    args = [str(ini) if a == "/etc/skred/skred.ini" else a for a in argv[1:]]
    config = load_config(args, environ={})
    assert config.main.data_dir == Path("/var/lib/skred")
    assert service["ExecReload"] == "/bin/kill -HUP $MAINPID", "reload is SIGHUP"
    assert service["User"] == "skred" and service["Restart"] == "on-failure"
    assert unit()["Install"]["WantedBy"] == "multi-user.target"


def test_systemd_analyze_accepts_the_unit(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian: systemd)")
    # verify wants the unit's binary to exist: point ExecStart at this interpreter.
    text = (REPO_ROOT / "deploy" / "skred.service").read_text()
    copy = tmp_path / "skred.service"
    copy.write_text(text.replace("/opt/skred/bin/skred", sys.executable))
    proc = subprocess.run([analyze, "verify", str(copy)], capture_output=True, text=True, timeout=60)
    problems = [line for line in proc.stderr.splitlines() if "skred.service" in line]
    assert not problems, proc.stderr
