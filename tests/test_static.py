"""The package type-checks under mypy --strict and passes ruff (STYLE.md habit 8)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_mypy_strict_on_the_package() -> None:
    r = _run(sys.executable, "-m", "mypy", "--strict", "broker")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_ruff_clean() -> None:
    r = _run(sys.executable, "-m", "ruff", "check", "broker", "tests", "benchmarks")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
