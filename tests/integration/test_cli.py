"""The ``python -m broker`` command line (Skred only)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ._support import REPO_ROOT, SkredProcess, assert_healthy, free_port, is_external

pytestmark = pytest.mark.skipif(
    is_external(), reason="tests the Skred command line; SKRED_TEST_EXTERNAL_URL points at another broker"
)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    return env


def test_help_lists_options_and_env_vars() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "broker", "--help"],
        cwd=str(REPO_ROOT),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    assert "--data-dir" in r.stdout
    assert "SKRED_AMQP_PORT" in r.stdout


class _EnvConfigured(SkredProcess):
    """Port and bind address from SKRED_* environment variables instead of flags."""

    def argv(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "broker",
            "--data-dir",
            str(self.data_dir),
            "--mgmt-port",
            str(self.mgmt_port),
        ]


def test_amqp_port_from_environment(tmp_path: Path) -> None:
    b = _EnvConfigured(tmp_path / "data")
    b.port = free_port()
    b.url = f"amqp://guest:guest@127.0.0.1:{b.port}/%2F"
    b.extra_env = {"SKRED_AMQP_PORT": str(b.port), "SKRED_AMQP_BIND": "127.0.0.1"}
    try:
        b.start()
        assert_healthy(b)
    finally:
        b.close()
