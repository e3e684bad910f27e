"""The package type-checks under mypy --strict and passes ruff (STYLE.md habit 8)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


# Pure CPU work, half a minute of one core on CI: its time is the machine's load, not a property
# of the package. Uncached on a machine loaded some twenty-fold, mypy took over the suite's
# default 300 s timeout; the deadline is generous rather than a pass/fail of the load.
DEADLINE = 840


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=DEADLINE)


@pytest.mark.timeout(DEADLINE + 60)
def test_mypy_strict_on_the_package() -> None:
    r = _run(sys.executable, "-m", "mypy", "--strict", "broker")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_ruff_clean() -> None:
    r = _run(sys.executable, "-m", "ruff", "check", "broker", "tests", "benchmarks")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_ruff_bans_wait_for_in_the_package() -> None:
    """asyncio.wait_for drops a cancel on 3.11 (pyproject's banned-api says why): the package may
    not use it again, in either spelling."""
    probe = "import asyncio\nfrom asyncio import wait_for\n\n\nasync def f() -> None:\n" \
            "    await asyncio.wait_for(asyncio.sleep(0), 1)\n    await wait_for(asyncio.sleep(0), 1)\n"
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "TID251", "--no-cache",
                        "--stdin-filename", "broker/probe.py", "-"], cwd=ROOT, input=probe,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "probe.py:2:" in r.stdout and "probe.py:6:" in r.stdout, r.stdout  # the import, the call
