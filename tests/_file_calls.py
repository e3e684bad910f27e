"""Which thread made the file-system calls a store makes (tests/test_segment_first.py,
tests/test_segment_delete.py): the event loop must not wait for a journal transaction."""

from __future__ import annotations

import os
import shutil
import threading

import pytest

from broker.store import segment_log


def worker_idle() -> None:
    """Every job handed to the segment worker so far is done (one thread, jobs in order)."""
    segment_log._spare_worker().submit(lambda: None).result(30)


def count_file_calls(monkeypatch: pytest.MonkeyPatch, removals: bool = False) -> list[tuple[bool, str]]:
    """(on the calling thread, call) of every call that creates, sizes, allocates or renames a
    file, and with ``removals`` also removes a directory (``rmdir``, ``shutil.rmtree``)."""
    calls: list[tuple[bool, str]] = []
    me = threading.current_thread()

    def counted(name: str, real: object, creates: bool = False) -> object:
        def call(*args: object, **kw: object) -> object:
            if not creates or (len(args) > 1 and int(args[1]) & os.O_CREAT):  # type: ignore[call-overload]
                calls.append((threading.current_thread() is me, name))
            return real(*args, **kw)  # type: ignore[operator]
        return call

    monkeypatch.setattr(os, "open", counted("open(O_CREAT)", os.open, creates=True))
    names = ["ftruncate", "truncate", "posix_fallocate", "rename", "replace", "unlink"]
    for name in names + (["rmdir"] if removals else []):
        monkeypatch.setattr(os, name, counted(name, getattr(os, name)))
    if removals:
        monkeypatch.setattr(shutil, "rmtree", counted("rmtree", shutil.rmtree))
    return calls
