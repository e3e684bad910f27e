"""PriorityStore as a ``MessageStore``: its run and one-at-a-time methods must agree, level by
level, highest first, with the level in every msgid (broker/store/priority_store.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pamqp import commands

from broker import properties
from broker.store.priority_store import PriorityStore
from broker.store.queue_store import QueueStore
from broker.store.segment import short_pair

EXRK = short_pair(b"ex", b"rk")
Seen = tuple[int, bytes, bytes, bytes, bool]


def _props(level: int | None) -> bytes:
    if level is None:
        return b"\x00\x00"
    return properties.encode(commands.Basic.Properties(priority=level))


def _messages() -> list[tuple[bytes, bytes]]:
    """(props, body): runs of equal priority (and body size) mixed with single messages."""
    out = []
    for i in range(120):
        level = None if i % 7 == 0 else (i // 5) % 9  # 9 levels asked for, 5 kept (capped)
        out.append((_props(level), b"m%03d" % i))
    return out


def _store(tmp: Path) -> PriorityStore:
    return PriorityStore(QueueStore(tmp), max_priority=5)


def _fill_one_by_one(store: PriorityStore) -> None:
    for p, body in _messages():
        store.append(1, b"ex", b"rk", p, body)


def _fill_runs(store: PriorityStore) -> None:
    msgs = _messages()
    i = 0
    while i < len(msgs):
        j = i + 1
        while j < len(msgs) and msgs[j][0] == msgs[i][0] and j - i < 6:
            j += 1
        same = j - i > 1  # one properties object; the bodies are all of one size
        if not same and j < len(msgs):
            j += 1  # a lone message goes in a mixed run with the next (maybe of another level)
        run = msgs[i:j]
        store.append_run(1, EXRK, [p for p, _ in run], [b for _, b in run], same)
        i = j


def _by_shift(store: PriorityStore) -> list[Seen]:
    out = []
    while (msgid := store.shift()) is not None:
        _ts, ex, rk, p, body = store.read(msgid)
        out.append((msgid, short_pair(ex, rk), p, body, store.is_redelivered(msgid)))
    return out


def _by_runs(store: PriorityStore, k: int, same: bool) -> list[Seen]:
    out: list[Seen] = []

    def one(msgid: int, exrk: bytes, p: bytes, body: bytes, red: bool) -> None:
        out.append((msgid, bytes(exrk), bytes(p), bytes(body), red))

    def run(msgids: range, exrk: bytes, p: bytes, bodies: list[bytes]) -> None:
        for msgid, body in zip(msgids, bodies, strict=True):
            one(msgid, exrk, p, body, False)

    while True:
        n, _red, _nb = store.deliver_run(k, False, one, 1 << 30, run if same else None)
        if n < k:
            return out


@pytest.mark.parametrize("k,same", [(1, False), (7, True), (500, True)])
def test_runs_deliver_what_shift_delivers(tmp_path: Path, k: int, same: bool) -> None:
    ref = _store(tmp_path / "ref")
    _fill_one_by_one(ref)
    expected = _by_shift(ref)
    assert [m[3] for m in expected] != [b for _, b in _messages()]  # priorities did reorder
    levels = [min(properties.priority(m[2]), 5) for m in expected]  # capped at max_priority
    assert levels == sorted(levels, reverse=True) and max(levels) == 5

    got_store = _store(tmp_path / "runs")
    _fill_runs(got_store)
    assert got_store.ready_count == len(expected)
    assert _by_runs(got_store, k, same) == expected
    assert got_store.ready_count == 0 and got_store.unacked_count == len(expected)


def test_next_delivery_requeue_and_ack_many(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _fill_one_by_one(store)
    total = store.ready_count
    first = [store.next_delivery(False) for _ in range(10)]
    assert all(d is not None for d in first)
    msgids = [d[0] for d in first if d is not None]
    store.requeue(msgids[3])
    again = store.next_delivery(False)
    assert again is not None and again[0] == msgids[3] and again[4] is True  # redelivered first
    store.ack_many(msgids)
    assert store.unacked_count == 0 and store.ready_count == total - 10
    taken = store.next_delivery(True)  # autoack: settled at once
    store.end_pass()
    assert taken is not None and store.unacked_count == 0 and store.ready_count == total - 11
