"""Where MQTT's retained messages and persistent sessions' state live (broker/mqtt/retained.py):
in their vhost's own directory, so they go wherever the vhost goes. Real broker processes on one
data dir: a data dir from before (the node-wide ``mqtt-retained`` and ``mqtt-sessions``, written
here in that format) keeps its retained message and session state, moved into the vhost's
directory at start (with two workers, every worker's vhosts at once), and a deleted vhost's go
with it; a node going from two workers to one and
back keeps the retained messages of both workers' vhosts (before, the node-wide directory of one
worker was kept and the other's left behind)."""

from __future__ import annotations

import hashlib
import json
import struct
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.shards.placement import worker_of

from ._support import SkredProcess
from .test_mqtt import Paho
from .test_workers import api

ALL = {"configure": ".*", "write": ".*", "read": ".*"}


def _new_vhost(b: SkredProcess, vhost: str) -> None:
    assert api(b, "PUT", f"/api/vhosts/{vhost}")[0] in (201, 204)
    assert api(b, "PUT", f"/api/permissions/{vhost}/guest", ALL)[0] in (201, 204)


def _publish_retained(b: SkredProcess, vhost: str, topic: str, payload: bytes) -> None:
    pub = Paho(b.host, b.mqtt_port, f"p-{urllib.parse.quote(vhost, safe='')}", user=f"{vhost}:guest")
    try:
        info = pub.c.publish(topic, payload, 1, retain=True)
        info.wait_for_publish(10)
        assert info.is_published()
    finally:
        pub.close()


def _legacy_retained(vhost: str, topic: str, payload: bytes) -> tuple[str, bytes]:
    """A retained message's file as the node-wide directory held it: name, content."""
    v, t = vhost.encode(), topic.encode()
    name = hashlib.sha256(v + b"\0" + t).hexdigest()[:40]
    return name, struct.pack(">H", len(v)) + v + struct.pack(">H", len(t)) + t + b"\x01" + payload


def _vhost_dir(data: Path, vhost: str) -> Path:
    return data / hashlib.sha1(vhost.encode(), usedforsecurity=False).hexdigest()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[list[SkredProcess]]:
    """The brokers a test starts on its data dir, one after another (closed at the end)."""
    started: list[SkredProcess] = []
    yield started
    for b in started:
        b.close()


def _start(started: list[SkredProcess], data: Path, workers: int) -> SkredProcess:
    b = SkredProcess(data, ["--workers", str(workers)])
    started.append(b)
    b.start()
    return b


def _retained(b: SkredProcess, vhost: str, topic: str) -> list[tuple[str, bytes, bool]]:
    sub = Paho(b.host, b.mqtt_port, f"r-{topic.replace('/', '-')}", user=f"{vhost}:guest")
    try:
        assert sub.subscribe(topic, 1) == [1]
        return [(m.topic, m.payload, bool(m.retain)) for m in sub.take(1, 5)]
    finally:
        sub.close()


def test_a_data_dir_from_before_keeps_its_retained_messages_and_sessions(
        tmp_path: Path, node: list[SkredProcess]) -> None:
    data = tmp_path / "data"
    name, content = _legacy_retained("/", "old/topic", b"kept")
    (data / "mqtt-retained").mkdir(parents=True)
    (data / "mqtt-retained" / name).write_bytes(content)
    session = hashlib.sha256(b"/\0away-client").hexdigest()[:40]  # a QoS 2 id awaiting its PUBREL
    (data / "mqtt-sessions").mkdir()
    (data / "mqtt-sessions" / session).write_bytes(json.dumps(
        {"vhost": "/", "client_id": "away-client", "qos2": [5], "shared": {}, "expires_at": 0}).encode())
    b = _start(node, data, 1)
    assert _retained(b, "/", "old/topic") == [("old/topic", b"kept", True)]
    status, doc = api(b, "GET", "/api/mqtt/sessions/%2F/away-client")  # the kept session, away
    assert status == 200, doc
    home = _vhost_dir(data, "/")  # moved into the vhost's directory: its shard's
    assert (home / "mqtt-retained" / name).read_bytes() == content
    assert (home / "mqtt-sessions" / session).exists()
    assert not (data / "mqtt-retained" / name).exists() and not (data / "mqtt-sessions" / session).exists()
    # a deleted vhost's retained messages go with it: one created again under its name has none
    _new_vhost(b, "gone")
    _publish_retained(b, "gone", "g/t", b"old")
    assert api(b, "DELETE", "/api/vhosts/gone")[0] == 204
    _new_vhost(b, "gone")
    sub = Paho(b.host, b.mqtt_port, "gone-sub", user="gone:guest")
    try:
        assert sub.subscribe("g/t", 1) == [1]
        _publish_retained(b, "gone", "g/t", b"new")  # on main the old one came first
        assert [(m.payload, bool(m.retain)) for m in sub.take(1)] == [(b"new", False)]
    finally:
        sub.close()


def test_retained_messages_of_both_workers_survive_a_change_of_workers(
        tmp_path: Path, node: list[SkredProcess]) -> None:
    data = tmp_path / "data"
    other = next(v for v in (f"mq{i}" for i in range(64)) if worker_of(v, 2) != worker_of("/", 2))
    b = _start(node, data, 2)
    _new_vhost(b, other)
    for vhost in ("/", other):
        _publish_retained(b, vhost, "w/t", vhost.encode())
    b.stop()
    for workers in (1, 2):  # on main: the vhost of one worker lost its retained message at 1
        b = _start(node, data, workers)
        for vhost in ("/", other):
            assert _retained(b, vhost, "w/t") == [("w/t", vhost.encode(), True)], (workers, vhost)
        b.stop()


def test_an_old_data_dir_reaches_every_workers_vhosts_at_once(
        tmp_path: Path, node: list[SkredProcess]) -> None:
    """The node-wide directories of a single-worker data dir, and a worker's own of an older
    multi-worker layout, are moved into every vhost's directory before the workers start (before,
    worker 0 moved only its own vhosts' files: the other worker's served none until a start with
    one worker)."""
    data = tmp_path / "data"
    other = next(v for v in (f"mq{i}" for i in range(64)) if worker_of(v, 2) != worker_of("/", 2))
    b = _start(node, data, 2)
    _new_vhost(b, other)
    b.stop()
    (data / "mqtt-retained").mkdir()
    for vhost in ("/", other):
        name, content = _legacy_retained(vhost, "old/a", vhost.encode())
        (data / "mqtt-retained" / name).write_bytes(content)
    stray = _legacy_retained("no-such-vhost", "old/a", b"x")  # kept where it is, not deleted
    (data / "mqtt-retained" / stray[0]).write_bytes(stray[1])
    elsewhere = data / "workers" / str(1 - worker_of("/", 2)) / "mqtt-retained"  # an older layout's
    elsewhere.mkdir(parents=True)
    name, content = _legacy_retained("/", "old/b", b"per-worker")
    (elsewhere / name).write_bytes(content)
    session = hashlib.sha256(f"{other}\0away-client".encode()).hexdigest()[:40]
    (data / "mqtt-sessions").mkdir()
    (data / "mqtt-sessions" / session).write_bytes(json.dumps(
        {"vhost": other, "client_id": "away-client", "qos2": [5], "shared": {}, "expires_at": 0}).encode())
    b = _start(node, data, 2)
    for vhost in ("/", other):  # on main: queue.Empty for the vhost of the worker that is not 0
        assert _retained(b, vhost, "old/a") == [("old/a", vhost.encode(), True)], vhost
    assert _retained(b, "/", "old/b") == [("old/b", b"per-worker", True)]
    status, doc = api(b, "GET", f"/api/mqtt/sessions/{other}/away-client")
    assert status == 200, doc
    assert sorted(p.name for p in (data / "mqtt-retained").iterdir()) == [stray[0]]
    assert not (elsewhere / name).exists() and not (data / "mqtt-sessions" / session).exists()
