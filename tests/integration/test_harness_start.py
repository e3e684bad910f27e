"""The harness's broker start (``_support.SkredProcess.start``) on a loaded machine.

Theory of operation: a ``sitecustomize`` module on the broker's PYTHONPATH stands in for a
loaded machine or a hung start, before the broker writes a line: it burns CPU for a few
seconds (a slow interpreter start that progresses) or sleeps (a start that hangs). The
readiness deadline is shortened to one second of no progress, so a fixed deadline of that
length fails the first case at once; the deadline that counts from the last progress waits
it out, and still gives up on the second within about that second.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from . import _support
from ._support import REPO_ROOT, SkredProcess, assert_healthy, is_external

pytestmark = pytest.mark.skipif(is_external(), reason="starts Skred processes of its own")

IDLE = 1.0  # the shortened readiness deadline (seconds without progress)


def _broker_with_startup(tmp_path: Path, code: str) -> SkredProcess:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(code)
    b = SkredProcess(tmp_path / "data")
    b.extra_env["PYTHONPATH"] = f"{REPO_ROOT}:{site}"
    return b


def test_a_slow_start_that_progresses_is_waited_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_support, "READY_DEADLINE", IDLE)
    b = _broker_with_startup(tmp_path, (
        "import time\n"
        f"end = time.monotonic() + {3 * IDLE!r}\n"
        "while time.monotonic() < end:\n"
        "    sum(range(1000))\n"))
    try:
        t0 = time.monotonic()
        b.start()
        assert time.monotonic() - t0 >= 3 * IDLE
        assert_healthy(b)
    finally:
        b.close()


def test_a_start_that_hangs_is_given_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_support, "READY_DEADLINE", IDLE)
    b = _broker_with_startup(tmp_path, "import time\ntime.sleep(60)\n")
    try:
        t0 = time.monotonic()
        with pytest.raises(pytest.fail.Exception, match="no progress"):
            b.start()
        assert time.monotonic() - t0 < 15 * IDLE  # the interpreter's own start-up is progress too
        assert not b.alive()
    finally:
        b.close()
