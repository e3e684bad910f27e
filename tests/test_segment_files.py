"""SegmentFiles: a node-wide bound on mapped segments (issue 14, item 6), no sockets.

Many stores share one small budget: appends, deliveries and acks on more stores than
the budget maps at once must all work, keep the bound, and recover exactly.
"""

from __future__ import annotations

from pathlib import Path

from broker.store.queue_store import QueueStore
from broker.store.segment_log import MIN_MAPS, SegmentFiles
from broker.store.stream_store import StreamStore

PROPS = b"\x10\x00\x02"  # delivery-mode 2


def test_more_stores_than_mapped_segments(tmp_path: Path) -> None:
    files = SegmentFiles(MIN_MAPS)
    n = 3 * MIN_MAPS
    stores = [QueueStore(tmp_path / f"q{i}", segment_size=4096, files=files, persistent_only=True)
              for i in range(n)]
    for rnd in range(3):  # round-robin: every append finds its store's mapping evicted
        for i, s in enumerate(stores):
            s.append(1, b"", b"q", PROPS, b"%d.%d" % (i, rnd))
            assert files.mapped <= MIN_MAPS
    assert files.evictions > n
    for i, s in enumerate(stores):  # take the first of each, ack it, leave two
        got = s.next_delivery(False)
        assert got is not None and got[3] == b"%d.0" % i
        s.ack(got[0])
        assert files.mapped <= MIN_MAPS
    for s in stores:
        s.sync(True)
        s.close()
    assert files.mapped == 0
    files = SegmentFiles(MIN_MAPS)
    for i in range(n):
        s = QueueStore(tmp_path / f"q{i}", segment_size=4096, files=files, persistent_only=True)
        bodies = []
        while (got := s.next_delivery(True)) is not None:
            bodies.append(got[3])
        assert bodies == [b"%d.1" % i, b"%d.2" % i]
        s.close()


def test_a_backlog_does_not_stay_mapped(tmp_path: Path) -> None:
    """Workload 8 at 10 M messages: every retired write segment stayed mapped until the
    cursor reached it, so a queue's backlog (10 GB) showed as the broker's RSS. Only the
    write segment, the one retired last (a caught-up consumer reads it next) and the
    cursor's segment stay mapped; the rest is mapped again when a reader gets there."""
    files = SegmentFiles()
    s = QueueStore(tmp_path / "q", segment_size=4096, files=files, persistent_only=True)
    for i in range(400):  # ~100 segments, nobody consuming
        s.append(1, b"", b"q", PROPS, b"%03d" % i + b"x" * 100)
        assert files.mapped <= 3, f"{files.mapped} segments mapped after {i + 1} appends"
    bodies = []
    while (got := s.next_delivery(False)) is not None:
        bodies.append(got[3][:3])
        s.ack(got[0])
        assert files.mapped <= 3
    assert bodies == [b"%03d" % i for i in range(400)]
    s.sync(True)
    s.close()


def test_a_stream_backlog_does_not_stay_mapped(tmp_path: Path) -> None:
    files = SegmentFiles()
    st = StreamStore(tmp_path / "s", segment_size=4096, files=files)
    for i in range(400):
        st.append(1, b"", b"s", PROPS, b"%03d" % i + b"x" * 100)
        assert files.mapped <= 2, f"{files.mapped} segments mapped after {i + 1} appends"
    p = st.seek(0)
    got = [r[5][:3] for _ in range(400) if (r := st.read_next(p)) is not None]
    assert got == [b"%03d" % i for i in range(400)]
    st.close()
