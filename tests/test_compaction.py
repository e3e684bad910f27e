"""The compaction rewrite shared by the sequences and delivery-counts files
(``broker/store/compaction.py``) on a real full disk: the temp file of the atomic rewrite is a
symlink to ``/dev/full``, so the kernel answers its write with ENOSPC. The rewrite must then
leave the old file and the appended records valid, raise the store's disk-full state, and let
the caller carry on (the next record tries again); no exception reaches the publisher. No
sockets."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from test_store import MirrorSink  # tests/ is on sys.path

from broker.store import delivery_counts, sequences
from broker.store.delivery_counts import DeliveryCounts
from broker.store.segment_log import SegmentFiles
from broker.store.sequences import SequenceLog

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")


def _full_tmp(path: Path) -> Path:
    """Make the rewrite's temp file of ``path`` land on /dev/full (ENOSPC on write)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.symlink_to("/dev/full")
    return tmp


def test_sequences_compaction_on_a_full_disk_keeps_the_log(tmp_path: Path) -> None:
    files, sink = SegmentFiles(), MirrorSink()
    log = SequenceLog(tmp_path, sink, files)
    for i in range(sequences.COMPACT_MIN):  # the next append compacts
        assert log.append("p", i + 1, i + 1)
    before = log.path.read_bytes()
    tmp = _full_tmp(log.path)
    assert not log.append("p", sequences.COMPACT_MIN + 1, sequences.COMPACT_MIN + 1)  # refused, no raise
    assert files.full and not tmp.exists()  # the disk-full state is raised; no temp file left
    assert log.path.read_bytes() == before == bytes(sink.files[log.path])  # old file, replica agrees
    files.space()
    assert log.append("p", sequences.COMPACT_MIN + 2, sequences.COMPACT_MIN + 2)  # space again: compacted
    assert len(sequences.decode(log.path.read_bytes())[0]) == 1
    assert bytes(sink.files[log.path]) == log.path.read_bytes()
    last = sequences.COMPACT_MIN + 2
    assert SequenceLog(tmp_path, sink, files).load(last) == {"p": last}


def test_delivery_counts_compaction_on_a_full_disk_keeps_the_counts(tmp_path: Path) -> None:
    files, sink, lock = SegmentFiles(), MirrorSink(), threading.Lock()
    counts = DeliveryCounts(str(tmp_path), lock, sink, files)
    for i in range(delivery_counts.COMPACT_MIN):
        counts.set(1, i + 1)
    with lock:
        counts.write_locked()
    tmp = _full_tmp(counts.path)
    counts.set(1, delivery_counts.COMPACT_MIN + 1)  # would compact: the disk is full, no raise
    assert files.full and not tmp.exists()
    with lock:
        counts.write_locked()  # the appended records stay the file's truth
    assert bytes(sink.files[counts.path]) == counts.path.read_bytes()
    again = DeliveryCounts.load(str(tmp_path), threading.Lock(), sink, files, lambda m: True, Path.unlink)
    assert again is not None and again.counts == {1: delivery_counts.COMPACT_MIN + 1}
    files.space()
    counts.set(1, delivery_counts.COMPACT_MIN + 2)  # space again: compacted to one record
    assert counts.path.stat().st_size == 4 + 12
    assert bytes(sink.files[counts.path]) == counts.path.read_bytes()
