"""An operator's first hour with ``skred``: one-line startup errors naming the option or
path, the log lines an operator reads, and SIGHUP reloading what can change at runtime.

Every case runs the real command (``python -m broker``) in a subprocess; a startup error
must be exactly one line on stderr, never a traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ._support import REPO_ROOT, is_external

pytestmark = pytest.mark.skipif(
    is_external(), reason="tests the Skred command line; SKRED_TEST_EXTERNAL_URL points at another broker"
)

RUN_TIMEOUT = 60.0  # seconds for one short-lived skred run (it must exit on its own)


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKRED_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    env.update(extra or {})
    return env


def run_skred(args: list[str], *, preamble: str = "",
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``skred ARGS`` to completion; ``preamble`` is Python run first in the same process."""
    code = f"{preamble}\nimport sys\nfrom broker.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=str(REPO_ROOT), env=_env(env),
        capture_output=True, text=True, timeout=RUN_TIMEOUT,
    )


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The single ``skred: error: ...`` line a failed start must print (log lines before it aside)."""
    assert result.returncode != 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1, result.stderr
    return errors[0]


def test_clustering_without_the_etcd_client_is_one_line(tmp_path: Path) -> None:
    # sys.modules[name] = None makes `import aetcd` fail exactly as if it were not installed.
    result = run_skred(["--data-dir", str(tmp_path / "d"), "--clustering"],
                       preamble="import sys; sys.modules['aetcd'] = None")
    line = one_error_line(result)
    assert "aetcd" in line and "clustering" in line, line
    assert result.returncode == 1
