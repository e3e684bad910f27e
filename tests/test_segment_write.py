"""segment.write_at: every byte lands, whatever the size of the writes the kernel takes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from broker.store import segment as fmt


def test_short_writes_are_finished(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pwrite/pwritev may write fewer bytes than asked (interrupted by a signal, say): the
    rest follows. Real writes to a real file, each cut to 3 bytes (nothing else makes a
    regular file's write come up short on demand)."""
    real_pwrite, real_pwritev = os.pwrite, os.pwritev

    def short_pwrite(fd: int, data: bytes, offset: int) -> int:
        return real_pwrite(fd, memoryview(data).cast("B")[:3], offset)

    def short_pwritev(fd: int, buffers: list[memoryview], offset: int) -> int:
        first = memoryview(buffers[0]).cast("B")
        return real_pwrite(fd, first[:3], offset)

    fd = os.open(tmp_path / "seg", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        for parts in ((b"abcdefghij",), (b"ab", memoryview(b"cdefg"), bytearray(b"h"), b"ij")):
            os.ftruncate(fd, 0)
            monkeypatch.setattr(os, "pwrite", short_pwrite)
            monkeypatch.setattr(os, "pwritev", short_pwritev)
            fmt.write_at(fd, 5, parts, 10)
            monkeypatch.setattr(os, "pwrite", real_pwrite)
            monkeypatch.setattr(os, "pwritev", real_pwritev)
            assert os.pread(fd, 20, 0) == bytes(5) + b"abcdefghij"
    finally:
        os.close(fd)
