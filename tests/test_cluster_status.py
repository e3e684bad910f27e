"""Unit tests for the cluster status view, its gauges, the status table and the lease clock (no sockets)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from prometheus_client import generate_latest

from broker.cluster.etcd import Etcd
from broker.cluster.leader import FollowerConn, LeaderSink
from broker.cluster.status import ClusterView, _coarse, format_status
from broker.metrics import cluster_registry


async def _no_isr(members: list[str]) -> bool:
    return True


class _Writer:
    def close(self) -> None:
        pass


def _leader_view(tmp_path: Path) -> tuple[ClusterView, LeaderSink]:
    sink = LeaderSink(tmp_path, "L", b"s" * 32, _no_isr)
    for fid, sent, acked in (("f1", 500, 200), ("f2", 80, 80)):
        f = FollowerConn(fid, f"127.0.0.9:{len(sink.followers) + 1000}", _Writer())  # type: ignore[arg-type]
        f.backlog = None
        f.sent, f.acked, f.synced = sent, acked, True
        sink.followers[fid] = f
    sink.isr.add("f2")
    view = ClusterView("L", "tcp://127.0.0.1:5679")
    view.set_role("leader", view.uri, sink)
    return view, sink


def _series(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def test_leader_view_reports_lag_isr_and_gauges(tmp_path: Path) -> None:
    view, sink = _leader_view(tmp_path)
    assert view.is_leader()
    assert view.follower_lags() == {"f1": 300, "f2": 0}
    st = view.status()
    assert st["leader"] == {"node_id": "L", "uri": "tcp://127.0.0.1:5679"}
    assert st["isr"] == ["L", "f2"]
    assert [(f["node_id"], f["lag_bytes"], f["in_isr"]) for f in st["followers"]] == \
        [("f1", 300, False), ("f2", 0, True)]
    m = _series(generate_latest(cluster_registry(view)).decode())
    assert m["skred_is_leader"] == 1
    assert m["skred_connected_followers"] == 2
    assert m['skred_follower_lag_in_bytes{id="f1"}'] == 300
    assert m['skred_follower_lag_in_bytes{id="f2"}'] == 0
    sink.fence()  # a fenced leader (lease lost) no longer counts as leader
    assert _series(generate_latest(cluster_registry(view)).decode())["skred_is_leader"] == 0


def test_follower_view_has_no_followers(tmp_path: Path) -> None:
    view = ClusterView("F", "tcp://127.0.0.2:5679")
    view.set_role("follower", "tcp://127.0.0.1:5679")
    assert not view.is_leader() and view.follower_lags() == {}
    m = _series(generate_latest(cluster_registry(view)).decode())
    assert m["skred_is_leader"] == 0 and m["skred_connected_followers"] == 0
    assert not any(k.startswith("skred_follower_lag_in_bytes") for k in m)
    assert view.status()["leader"] == {"uri": "tcp://127.0.0.1:5679"}
    assert view.member_record() == {"uri": "tcp://127.0.0.2:5679", "role": "follower", "warm": False}
    view.warm = True  # followed in sync: a cold node defers to it in an election
    assert view.member_record()["warm"] is True


def test_follower_exports_its_own_process_memory_and_disk(tmp_path: Path) -> None:
    view = ClusterView("F", "tcp://127.0.0.2:5679")
    view.set_role("follower", "tcp://127.0.0.1:5679")
    m = _series(generate_latest(cluster_registry(view, tmp_path)).decode())
    for prefix in ("skred", "rabbitmq"):
        assert m[f"{prefix}_process_resident_memory_bytes"] > 0
        assert m[f"{prefix}_disk_space_available_bytes"] > 0
        assert m[f"{prefix}_process_open_fds"] > 0
    assert any(k.startswith("rabbitmq_identity_info{") for k in m)


def test_member_record_rounds_lag() -> None:
    assert [_coarse(n) for n in (0, 99, 100, 1234, 98765)] == [0, 99, 100, 1200, 98000]


def test_status_table() -> None:
    status: dict[str, Any] = {
        "etcd": "127.0.0.1:2379", "prefix": "skred", "isr": ["a", "b"],
        "leader": {"node_id": "a", "uri": "tcp://h1:5679"},
        "members": [
            {"node_id": "a", "uri": "tcp://h1:5679", "role": "leader", "in_isr": True, "lag_bytes": None},
            {"node_id": "b", "uri": "tcp://h2:5679", "role": "follower", "in_isr": True, "lag_bytes": 1200},
            {"node_id": "c", "uri": None, "role": "down", "in_isr": False, "lag_bytes": None},
        ],
    }
    lines = format_status(status).splitlines()
    assert lines[1] == "leader: a tcp://h1:5679"
    assert lines[2] == "ISR:    a, b"
    rows = [line.split() for line in lines[4:]]
    assert rows == [["NODE", "URI", "ROLE", "IN", "ISR", "LAG", "BYTES"],
                    ["a", "tcp://h1:5679", "leader", "yes", "-"],
                    ["b", "tcp://h2:5679", "follower", "yes", "1200"],
                    ["c", "-", "down", "no", "-"]]


def test_lease_clock_counts_from_the_refresh_sent() -> None:
    etcd = Etcd("127.0.0.1:1", "p", 2)
    assert not etcd.lease_alive()  # no lease yet
    etcd.lease_id = 7
    etcd.last_refresh = time.monotonic() - 1.5
    assert etcd.lease_alive()
    assert 0.3 < etcd.lease_deadline() - time.monotonic() <= 0.5
    etcd.last_refresh = time.monotonic() - 2.01
    assert not etcd.lease_alive()


def test_barrier_refuses_once_the_lease_clock_ran_out(tmp_path: Path) -> None:
    async def run() -> tuple[bool, bool, bool]:
        sink = LeaderSink(tmp_path, "L", b"s" * 32, _no_isr)
        alive = [True]
        sink.lease_valid = lambda: alive[0]
        first = sink.barrier()
        alive[0] = False
        second = sink.barrier()
        await asyncio.sleep(0)
        return first.done(), second.done(), sink.fenced

    assert asyncio.run(run()) == (True, False, True)


def test_standing_orders_members_by_completeness(tmp_path: Path) -> None:
    from broker.cluster.standing import Standing, load_last_role, save_last_role

    cold_leader = Standing.of({"last": {"role": "leader", "term": 7}})
    cold_follower = Standing.of({"last": {"role": "follower", "term": 7}})
    older = Standing.of({"last": {"role": "follower", "term": 5}})
    warm = Standing.of({"warm": True})
    assert warm > cold_follower > cold_leader > older > Standing.of({})
    assert load_last_role(tmp_path) == {}
    save_last_role(tmp_path, "follower", 7)
    assert load_last_role(tmp_path) == {"role": "follower", "term": 7}
