"""Single-node chaos (marker ``chaos``): the trials of ``single_faults.py`` not covered
elsewhere, with small counts, each asserting the goal.

Theory of operation: kill -9 at a random moment under live traffic (a confirmed publisher and
an acking consumer on one queue), twice; and one full-disk trial on a small tmpfs (pipelined
confirmed publishes to two queues until nacks, kill -9, space freed). Goals: no confirmed
message lost, no ack older than the sync window back, every delivered message back flagged
redelivered, no nacked message stored, no broker death and no traceback. Settlements after
the window and the synchronous mode are ``test_ack_window.py``'s; the fuzz is
``test_chaos_fuzz.py``'s; ``benchmarks/chaos.py`` runs all of them 20 times.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from ._support import Broker, SkredProcess, is_external
from ._tmpfs import NEEDS, NamespacedBroker, mount_tmpfs
from .single_faults import Trial, trial_full_disk, trial_live

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(240),
              pytest.mark.skipif(is_external(), reason="kills the Skred process")]


def _assert_goals(t: Trial) -> None:
    assert (t.lost, t.resurrected, t.missing_redelivered, t.deaths, t.tracebacks, t.wrong) == (0,) * 6, t
    assert not t.notes, t


def test_kill9_under_live_traffic(broker: Broker) -> None:
    assert isinstance(broker, SkredProcess)
    rng = random.Random()
    for _ in range(2):
        t = trial_live(broker, rng)
        print(t)
        assert t.confirmed and t.settled, t
        _assert_goals(t)
    assert "Traceback" not in broker.log_text()


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[tuple[Path, int]]:
    yield from mount_tmpfs(tmp_path, 16 * 1024 * 1024)


@NEEDS
def test_full_disk_trial(tmpfs: tuple[Path, int], tmp_path: Path) -> None:
    mnt, holder = tmpfs
    b = NamespacedBroker(mnt / "data", holder, ["--free-disk-min", "0", "--segment-size", "256KiB"])
    b.log_path = tmp_path / "broker.log"
    try:
        b.start()
        t = trial_full_disk(b, random.Random(), mnt, b.run_inside)
        print(t)
        assert t.confirmed, t
        _assert_goals(t)
    finally:
        b.close()
