"""Pieces of a multi-worker node without a broker: the data-dir layout when the number of
workers changes, the control channel's message and descriptor passing, the management
answers merged from several workers (broker/shards)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from broker.shards import control, layout
from broker.shards.fanout import add_counts, merge_metrics
from broker.shards.placement import worker_of
from broker.store.paths import vhost_dir


def _make_vhost(base: Path, name: str) -> Path:
    d = vhost_dir(base, name)
    d.mkdir(parents=True)
    (d / ".vhost").write_text(name)
    (d / "definitions.amqp").write_bytes(b"x")
    return d


def test_relocate_moves_vhosts_to_their_owner_and_back(tmp_path: Path) -> None:
    names = [f"v{i}" for i in range(12)] + ["/"]
    for n in names:  # a node that ran one worker
        _make_vhost(tmp_path, n)
    moved = layout.relocate(tmp_path, names, 4)
    assert len(moved) == len(names)
    for n in names:
        home = layout.worker_dir(tmp_path, worker_of(n, 4), 4)
        assert (vhost_dir(home, n) / ".vhost").read_text() == n
        assert not vhost_dir(tmp_path, n).exists()
    assert layout.relocate(tmp_path, names, 4) == []  # settled: nothing moves again
    moved = layout.relocate(tmp_path, names, 2)  # fewer workers: only what the map moves
    assert {n for n, _a, _b in moved} == {n for n in names if worker_of(n, 4) != worker_of(n, 2)}
    layout.relocate(tmp_path, names, 1)  # back to one worker: today's layout
    for n in names:
        assert (vhost_dir(tmp_path, n) / "definitions.amqp").read_bytes() == b"x"


def test_relocate_leaves_a_vhost_without_a_directory_alone(tmp_path: Path) -> None:
    assert layout.relocate(tmp_path, ["never-created"], 2) == []


def test_control_channel_carries_messages_and_descriptors(tmp_path: Path) -> None:
    parent, child = control.pair()
    r, w = os.pipe()
    try:
        control.send(child, {"op": "handover", "state": {"vhost": "v", "rest": b"\x01\x02"}}, [r])
        got = control.receive(parent)
        assert got is not None
        message, fds = got
        assert message == {"op": "handover", "state": {"vhost": "v", "rest": b"\x01\x02"}}
        assert len(fds) == 1
        os.write(w, b"through")
        assert os.read(fds[0], 16) == b"through"  # the same pipe, passed
        os.close(fds[0])
        child.close()
        assert control.receive(parent) is None  # the worker's end closed
    finally:
        for fd in (r, w):
            os.close(fd)
        parent.close()


def test_control_channel_refuses_oversized_messages() -> None:
    a, b = control.pair()
    try:
        with pytest.raises(ValueError):
            control.send(a, {"op": "x", "blob": b"\0" * (control.MAX_MESSAGE + 1)})
    finally:
        a.close()
        b.close()


def test_metrics_of_workers_add_up() -> None:
    w0 = ("# HELP rabbitmq_queues Queues\n# TYPE rabbitmq_queues gauge\nrabbitmq_queues 2\n"
          'rabbitmq_build_info{version="1"} 1\nrabbitmq_published_total 10.5\n'
          'rabbitmq_queue_messages{queue="a"} 3\n')
    w1 = ("# HELP rabbitmq_queues Queues\n# TYPE rabbitmq_queues gauge\nrabbitmq_queues 3\n"
          'rabbitmq_build_info{version="1"} 1\nrabbitmq_published_total 1\n'
          'rabbitmq_queue_messages{queue="b"} 4\n')
    merged = merge_metrics([w0, w1]).splitlines()
    assert merged.count("# HELP rabbitmq_queues Queues") == 1
    assert "rabbitmq_queues 5" in merged
    assert 'rabbitmq_build_info{version="1"} 1' in merged  # the same fact, not added up
    assert "rabbitmq_published_total 11.5" in merged
    assert 'rabbitmq_queue_messages{queue="a"} 3' in merged
    assert 'rabbitmq_queue_messages{queue="b"} 4' in merged


def test_overview_counts_add_up() -> None:
    a = {"node": "n", "object_totals": {"queues": 1, "connections": 2},
         "queue_totals": {"messages": 5, "messages_details": {"rate": 1.0}}, "message_stats": {}}
    b = {"node": "n", "object_totals": {"queues": 3, "connections": 0},
         "queue_totals": {"messages": 1, "messages_details": {"rate": 0.5}},
         "message_stats": {"publish": 7}}
    add_counts(a, b)
    assert a["object_totals"] == {"queues": 4, "connections": 2}
    assert a["queue_totals"] == {"messages": 6, "messages_details": {"rate": 1.5}}
    assert a["message_stats"] == {"publish": 7}
    assert a["node"] == "n"


def test_relocate_moves_node_files_a_worker_keeps(tmp_path: Path) -> None:
    (tmp_path / "mqtt-retained").mkdir()
    (tmp_path / "mqtt-retained" / "blob").write_bytes(b"r")
    (tmp_path / "lmq.json").write_text("{}")
    layout.relocate(tmp_path, [], 2, {"mqtt-retained": 0, "lmq.json": 1})
    assert (tmp_path / "workers" / "0" / "mqtt-retained" / "blob").read_bytes() == b"r"
    assert (tmp_path / "workers" / "1" / "lmq.json").read_text() == "{}"
    layout.relocate(tmp_path, [], 1, {"mqtt-retained": 0, "lmq.json": 0})
    assert (tmp_path / "mqtt-retained" / "blob").exists() and (tmp_path / "lmq.json").exists()


def test_mqtt_state_of_older_layouts_reaches_every_workers_vhosts(tmp_path: Path) -> None:
    """node.adopt_mqtt_dirs, run by the parent before any worker: the node-wide retained messages
    and a worker's own of an older layout move into the directory of each vhost in its owner of
    two workers; a file of an unknown vhost stays; a move a crash cut off is redone."""
    from broker.mqtt.retained import Retained
    from broker.node import adopt_mqtt_dirs
    from broker.store.blobs import BlobDir

    def files(directory: Path) -> BlobDir:
        return BlobDir(directory, lambda _f: None)
    other = next(v for v in (f"mq{i}" for i in range(64)) if worker_of(v, 2) != worker_of("/", 2))
    Retained(lambda _v: files(tmp_path / "mqtt-retained"), 10).set("/", "a", 1, b"root")
    Retained(lambda _v: files(tmp_path / "mqtt-retained"), 10).set("unknown", "a", 1, b"kept")
    Retained(lambda _v: files(tmp_path / "workers" / "1" / "mqtt-retained"), 10).set(other, "a", 1, b"w1")
    crashed = layout.worker_dir(tmp_path, worker_of(other, 2), 2)  # copied, the old file not yet gone
    Retained(lambda _v: files(vhost_dir(crashed, other) / "mqtt-retained"), 10).set(other, "a", 1, b"w1")
    adopt_mqtt_dirs(tmp_path, ["/", other], 2)
    for vhost, payload in (("/", b"root"), (other, b"w1")):
        home = vhost_dir(layout.worker_dir(tmp_path, worker_of(vhost, 2), 2), vhost) / "mqtt-retained"
        assert Retained(lambda _v, h=home: files(h), 10).matching(vhost, "#") == [("a", 1, payload)]
    assert len(list((tmp_path / "mqtt-retained").iterdir())) == 1  # the unknown vhost's
    assert list((tmp_path / "workers" / "1" / "mqtt-retained").iterdir()) == []
