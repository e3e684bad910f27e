"""A queue's paused state in the definitions log: replayed at boot, kept by compaction, and
dropped with the queue (no sockets: a VHost on a temporary directory)."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.model.vhost import VHost
from broker.store.sink import NullSink


def _vhost(tmp: Path) -> VHost:
    return VHost("/", tmp / "data", segment_size=64 * 1024, sink=NullSink(), schedule=lambda cb: cb(),
                 mark_dirty=lambda _obj: None, transient_root=tmp / "transient")


@pytest.mark.parametrize("compact", [False, True])
def test_paused_state_is_replayed(tmp_path: Path, compact: bool) -> None:
    vh = _vhost(tmp_path)
    for name in ("a", "b", "c", "gone"):
        vh.declare_queue(name, durable=True, owner=None)
    vh.pause_queue("a", True)
    vh.pause_queue("b", True)
    vh.pause_queue("b", False)
    vh.pause_queue("gone", True)
    vh.delete_queue("gone", owner=None)
    vh.declare_queue("gone", durable=True, owner=None)  # a new queue of that name: running
    if compact:
        vh.compact()
    vh.definitions.close()
    again = _vhost(tmp_path)
    assert {n: q.paused for n, q in again.queues.items()} == {"a": True, "b": False, "c": False,
                                                            "gone": False}
