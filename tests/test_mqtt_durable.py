"""A persistent MQTT session's durable state (broker/mqtt/durable.py), with no sockets: what is
kept comes back as it was, an empty state leaves no file, a file this code did not write is
skipped with a warning."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from broker.mqtt import props as PR
from broker.mqtt.durable import PendingWill, SessionState, SessionStates
from broker.mqtt.packets import Will


class MemoryFiles:
    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}

    def put(self, name: str, data: bytes) -> None:
        self.files[name] = data

    def delete(self, name: str) -> None:
        self.files.pop(name, None)

    def items(self) -> Iterator[tuple[str, bytes]]:
        yield from sorted(self.files.items())


def test_state_round_trips_and_an_empty_one_leaves_no_file(caplog: pytest.LogCaptureFixture) -> None:
    files = MemoryFiles()
    states = SessionStates(lambda _v: files)
    will = Will("a/b", b"\x00bye", 1, True, {PR.WILL_DELAY: 30, PR.USER_PROPERTY: [("k", "v")]})
    kept = SessionState({1, 65535}, {"$share/g/x/#": (1, 7)}, PendingWill(will, "user", 1234.5), 99.0)
    states.save(("/", "c1"), kept)
    states.save(("vh", "c1"), SessionState({3}))  # the same client id in another vhost: its own
    assert len(files.files) == 2
    again = SessionStates(lambda _v: files)  # each vhost's state read as it opens here
    assert again.open("/") == [("/", "c1")] and again.open("vh") == [("vh", "c1")] and again.open("/") == []
    assert again.by_key[("/", "c1")] == kept and again.by_key[("vh", "c1")] == SessionState({3})
    assert again.get(("/", "other")) == SessionState()
    assert kept.expired(99.0) and not kept.expired(98.9) and not SessionState().expired(1e12)
    again.save(("vh", "c1"), SessionState())  # nothing left to keep: no file
    assert len(files.files) == 1 and ("vh", "c1") not in again.by_key
    files.put("garbage", b"{not json")
    with caplog.at_level(logging.WARNING):
        third = SessionStates(lambda _v: files)
        third.open("/")
    assert list(third.by_key) == [("/", "c1")] and "garbage" in caplog.text


def test_a_live_will_keeps_its_delay() -> None:
    """A will kept while its client is connected (due 0) comes back with its will delay."""
    files = MemoryFiles()
    live = PendingWill(Will("t", b"x", 0, False), "u", 0.0, 5.0)
    SessionStates(lambda _v: files).save(("/", "c"), SessionState(will=live))
    back_states = SessionStates(lambda _v: files)
    back_states.open("/")
    back = back_states.by_key[("/", "c")].will
    assert back == live and back is not None and back.live
