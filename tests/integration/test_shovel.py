"""Dynamic shovels between real Skred brokers on loopback: parameters, status, pause, the local
(host-less ``amqp://``) ends, a remote Skred over AMQP, an HTTP destination, a stream source,
kill -9 of either end during an on-confirm shovel, and bad parameters.

Two brokers per module (``a`` and ``b``); the kill -9 tests restart the one they kill. Counts
are small for the suite: the kill -9 trials (marked chaos) move 5,000 messages of 1 KiB;
``SKRED_SHOVEL_KILL_MESSAGES=100000`` runs the issue's 100,000.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator

import pytest

from ._shovel import (
    HttpSink,
    count,
    drain,
    ids,
    publish,
    put_shovel,
    q,
    shovel_status,
    wait_state,
)
from ._support import SkredProcess, free_port, is_external, unique, wait_until
from .test_cluster import Cluster, ClusterNode, start_cluster, wait_for
from .test_cluster import cluster as cluster  # noqa: F401 - the three-node cluster fixture
from .test_ctl import ctl
from .test_mgmt_api import Api, http_ready, start_mgmt_broker

pytestmark = pytest.mark.skipif(is_external(), reason="starts Skred brokers of its own")

KILL_MESSAGES = int(os.environ.get("SKRED_SHOVEL_KILL_MESSAGES", "5000"))


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SkredProcess, SkredProcess]]:
    root = tmp_path_factory.mktemp("shovel")
    a = start_mgmt_broker(root)
    try:
        b = start_mgmt_broker(root)
    except BaseException:
        a.close()
        raise
    yield a, b
    a.close()
    b.close()


def local(a: SkredProcess) -> tuple[Api, str]:
    return Api(a.mgmt_port), a.url


def remote_uri(b: SkredProcess) -> str:
    return f"amqp://guest:guest@127.0.0.1:{b.port}/%2F"


def restart(b: SkredProcess) -> None:
    b.restart()
    wait_until(lambda: http_ready(b.mgmt_port), 20, "management listener after restart")


# --------------------------------------------------------------------- parameters
@pytest.mark.parametrize("value,expect", [
    ({"src-uri": "amqp://", "src-queue": "x", "dest-uri": "amqp://", "dest-queue": "y", "bogus": 1},
     "unknown shovel parameter key(s): bogus"),
    ({"src-uri": "amqp://h:notaport", "src-queue": "x", "dest-uri": "amqp://", "dest-queue": "y"},
     "'src-uri': bad URI"),
    ({"src-uri": "http://h/", "src-queue": "x", "dest-uri": "amqp://", "dest-queue": "y"},
     "'src-uri': URI scheme"),
    ({"src-uri": "amqp://", "dest-uri": "amqp://", "dest-queue": "y"}, "exactly one of 'src-queue'"),
    ({"src-uri": "amqp://", "src-queue": "x", "dest-queue": "y"}, "needs 'src-uri' and 'dest-uri'"),
    ({"src-uri": "amqp://", "src-queue": "x", "dest-uri": "amqp://", "ack-mode": "sometimes"}, "'ack-mode'"),
    ({"src-uri": "amqp://", "src-queue": "x", "dest-uri": "amqp://", "src-prefetch-count": 0},
     "'src-prefetch-count'"),
    ({"src-uri": "amqps://", "src-queue": "x", "dest-uri": "amqp://"}, "no host"),
    ("not an object", "must be a JSON object"),
])
def test_bad_parameters_are_400_with_the_reason(pair: tuple[SkredProcess, SkredProcess], value: object,
                                                 expect: str) -> None:
    api, _ = local(pair[0])
    name = unique("bad")
    status, body = put_shovel(api, "/", name, value)  # type: ignore[arg-type]
    assert status == 400 and expect in body["reason"], body
    assert api.call("GET", f"/api/parameters/shovel/%2F/{q(name)}")[0] == 404
    assert api.get("/api/aliveness-test/%2F") == {"status": "ok"}


# ------------------------------------------------------------------- local ends
def test_local_to_local_moves_everything_and_reports_status(pair: tuple[SkredProcess, SkredProcess]) -> None:
    a = pair[0]
    api, url = local(a)
    src, dst, name = unique("src"), unique("dst"), unique("sh")
    publish(url, src, "m", 300, declare={})
    value = {"src-uri": "amqp://", "src-queue": src, "dest-uri": "amqp://", "dest-queue": dst,
             "dest-add-forward-headers": True, "reconnect-delay": 1}
    assert put_shovel(api, "/", name, value)[0] == 201
    wait_until(lambda: count(api, "/", dst) == 300 and count(api, "/", src) == 0, 20, "300 moved")
    st = wait_state(api, "/", name, "running")
    assert {st["src_queue"], st["dest_queue"], st["type"], st["src_uri"]} == {src, dst, "dynamic", "amqp://"}
    assert st["messages_transferred"] == 300 and st["node"]
    assert api.get(f"/api/shovels/vhost/%2F/{q(name)}")["name"] == name
    assert api.get(f"/api/parameters/shovel/%2F/{q(name)}")["value"] == value
    exported = api.get("/api/definitions")["parameters"]
    assert {"vhost": "/", "component": "shovel", "name": name, "value": value} in exported
    assert sorted(drain(url, dst)) == sorted(ids("m", 300))
    assert api.call("DELETE", f"/api/parameters/shovel/%2F/{q(name)}")[0] == 204
    wait_until(lambda: shovel_status(api, "/", name) is None, 10, "shovel gone")


def test_definitions_import_starts_a_shovel(pair: tuple[SkredProcess, SkredProcess]) -> None:
    a = pair[0]
    api, url = local(a)
    src, dst, name = unique("src"), unique("dst"), unique("sh")
    doc = {"queues": [{"name": src, "vhost": "/", "durable": True, "auto_delete": False, "arguments": {}}],
           "parameters": [{"vhost": "/", "component": "shovel", "name": name,
                           "value": {"src-uri": "amqp://", "src-queue": src, "dest-uri": "amqp://",
                                     "dest-queue": dst}}]}
    assert api.call("POST", "/api/definitions", doc)[0] in (200, 201, 204)
    publish(url, src, "d", 20)
    wait_until(lambda: count(api, "/", dst) == 20, 20, "20 moved by the imported shovel")
    bad = {"parameters": [{"vhost": "/", "component": "shovel", "name": unique("x"),
                           "value": {"src-uri": 1}}]}
    status, body, _ = api.call("POST", "/api/definitions", bad)
    assert status == 400 and "src-uri" in str(body), body
    api.ok("DELETE", f"/api/parameters/shovel/%2F/{q(name)}")


def test_pause_survives_restart_and_resume_moves_on(pair: tuple[SkredProcess, SkredProcess]) -> None:
    a = pair[0]
    api, url = local(a)
    src, dst, name = unique("src"), unique("dst"), unique("sh")
    publish(url, src, "p", 10, declare={})
    assert put_shovel(api, "/", name, {"src-uri": "amqp://", "src-queue": src, "dest-uri": "amqp://",
                                       "dest-queue": dst})[0] == 201
    wait_until(lambda: count(api, "/", dst) == 10, 20, "first 10 moved")
    api.ok("PUT", f"/api/shovels/%2F/{q(name)}/pause")
    wait_state(api, "/", name, "paused")
    restart(a)
    api = Api(a.mgmt_port)
    publish(url, src, "p2", 10)
    assert wait_state(api, "/", name, "paused")
    assert count(api, "/", src) == 10  # nothing moves while paused
    api.ok("PUT", f"/api/shovels/%2F/{q(name)}/resume")
    wait_until(lambda: count(api, "/", dst) == 20 and count(api, "/", src) == 0, 20, "resumed and moved")
    api.ok("DELETE", f"/api/shovels/vhost/%2F/{q(name)}/restart")
    wait_state(api, "/", name, "running")
    assert api.call("DELETE", f"/api/shovels/vhost/%2F/{q(unique('none'))}/restart")[0] == 404
    api.ok("DELETE", f"/api/parameters/shovel/%2F/{q(name)}")


def test_skredctl_shovel_commands(pair: tuple[SkredProcess, SkredProcess]) -> None:
    a = pair[0]
    api, url = local(a)
    src, dst, name = unique("src"), unique("dst"), unique("sh")
    publish(url, src, "c", 5, declare={})

    def ok(*args: str) -> str:
        r = ctl(a, *args)
        assert r.returncode == 0, (args, r.stdout, r.stderr)
        return r.stdout
    assert "saved" in ok("add_shovel", name, "--src-uri", "amqp://", "--src-queue", src, "--dest-uri", "amqp://",
                         "--dest-queue", dst, "--src-prefetch-count", "10", "--reconnect-delay", "1")
    wait_until(lambda: count(api, "/", dst) == 5, 20, "moved by the shovel skredctl added")
    rows = json.loads(ok("--json", "list", "shovels", "--vhost", "/"))
    assert any(r["name"] == name and r["state"] == "running" for r in rows)
    assert name in ok("list", "shovels")
    ok("pause_shovel", name)
    wait_state(api, "/", name, "paused")
    ok("resume_shovel", name)
    ok("restart_shovel", name)
    wait_state(api, "/", name, "running")
    bad = ctl(a, "add_shovel", unique("x"), "--src-uri", "amqp://", "--dest-uri", "amqp://")
    assert bad.returncode == 1 and "exactly one of 'src-queue'" in bad.stderr
    ok("delete_shovel", name)
    assert api.call("GET", f"/api/parameters/shovel/%2F/{q(name)}")[0] == 404


def test_delete_after_queue_length_moves_the_backlog_then_deletes_itself(
        pair: tuple[SkredProcess, SkredProcess]) -> None:
    a = pair[0]
    api, url = local(a)
    src, dst, name = unique("src"), unique("dst"), unique("sh")
    publish(url, src, "l", 25, declare={})
    assert put_shovel(api, "/", name, {"src-uri": "amqp://", "src-queue": src, "dest-uri": "amqp://",
                                       "dest-queue": dst, "src-delete-after": "queue-length"})[0] == 201
    wait_until(lambda: api.call("GET", f"/api/parameters/shovel/%2F/{q(name)}")[0] == 404, 20,
               "the shovel deleted itself")
    assert count(api, "/", dst) == 25


def test_stream_source_from_an_offset_resumes_after_restart(pair: tuple[SkredProcess, SkredProcess]) -> None:
    """A stream queue as the source from ``x-stream-offset`` (LavinMQ cannot): the first run starts
    at the given offset, later runs (a restart) resume after the last settled one."""
    a = pair[0]
    api, url = local(a)
    stream, dst, name = unique("stream"), unique("dst"), unique("sh")
    publish(url, stream, "s", 10, declare={"x-queue-type": "stream"})
    assert put_shovel(api, "/", name, {"src-uri": "amqp://", "src-queue": stream, "dest-uri": "amqp://",
                                       "dest-queue": dst, "src-prefetch-count": 4,
                                       "src-consumer-args": {"x-stream-offset": 3}})[0] == 201
    wait_until(lambda: count(api, "/", dst) == 7, 20, "offsets 3..9 moved")
    restart(a)
    api = Api(a.mgmt_port)
    publish(url, stream, "t", 2)
    wait_until(lambda: count(api, "/", dst) >= 9, 20, "the two new ones moved after the restart")
    got = drain(url, dst)
    assert sorted(got) == sorted({f"s#{i}" for i in range(3, 10)} | ids("t", 2)), got
    api.ok("DELETE", f"/api/parameters/shovel/%2F/{q(name)}")


def test_reject_publish_at_the_destination_slows_the_shovel_and_drains_nothing(
        pair: tuple[SkredProcess, SkredProcess]) -> None:
    """A destination queue at its length limit with ``reject-publish`` refuses: the shovel retries
    with back-off, holds at most its prefetch, and the source keeps the rest until there is room."""
    a = pair[0]
    api, url = local(a)
    src, dst, name = unique("src"), unique("dst"), unique("sh")
    publish(url, dst, "none", 0, declare={"x-max-length": 10, "x-overflow": "reject-publish"})
    publish(url, src, "f", 50, declare={})
    assert put_shovel(api, "/", name, {"src-uri": "amqp://", "src-queue": src, "dest-uri": "amqp://",
                                       "dest-queue": dst, "src-prefetch-count": 5})[0] == 201
    wait_until(lambda: count(api, "/", dst) == 10, 20, "the destination full")
    wait_until(lambda: (shovel_status(api, "/", name) or {}).get("blocked_status") == "blocked"
               and (shovel_status(api, "/", name) or {}).get("messages_transferred") == 10, 10,
               "the shovel blocked after 10")
    assert count(api, "/", src) == 40 and count(api, "/", dst) == 10  # nothing dropped, nothing drained
    got = drain(url, dst)  # room again: the shovel moves on
    wait_until(lambda: count(api, "/", src) <= 30, 20, "moving again once there is room")
    api.ok("DELETE", f"/api/parameters/shovel/%2F/{q(name)}")
    wait_until(lambda: api.get(f"/api/queues/%2F/{q(src)}")["consumers"] == 0, 20, "the shovel stopped")
    got += drain(url, dst) + drain(url, src)
    assert sorted(set(got)) == sorted(ids("f", 50))


# ----------------------------------------------------------------- HTTP destination
def test_http_destination_500_then_404_then_200_loses_nothing(
        pair: tuple[SkredProcess, SkredProcess]) -> None:
    a = pair[0]
    api, url = local(a)
    src, name = unique("src"), unique("sh")
    publish(url, src, "h", 20, declare={})
    with HttpSink([500, 404, 503, 404]).running() as sink:
        assert put_shovel(api, "/", name, {"src-uri": "amqp://", "src-queue": src,
                                           "dest-uri": f"http://127.0.0.1:{sink.port}/in"})[0] == 201
        wait_until(lambda: count(api, "/", src) == 0 and len({b for b in sink.accepted}) == 20, 30,
                   "every message POSTed with a 2xx")
        assert {b.split(b"|")[0].decode() for b in sink.accepted} == ids("h", 20)
        assert sink.answered[:4] == [500, 404, 503, 404]
        assert sink.headers[0]["X-Routing-Key"] == src and sink.headers[0]["X-Message-Id"] == "x"
        api.ok("DELETE", f"/api/parameters/shovel/%2F/{q(name)}")


def test_http_refused_for_good_goes_to_the_source_dead_letter_exchange(
        pair: tuple[SkredProcess, SkredProcess]) -> None:
    a = pair[0]
    api, url = local(a)
    src, dlq, name = unique("src"), unique("dlq"), unique("sh")
    publish(url, dlq, "none", 0, declare={})
    publish(url, src, "r", 3, declare={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dlq})
    with HttpSink([404]).running() as sink:
        assert put_shovel(api, "/", name, {"src-uri": "amqp://", "src-queue": src,
                                           "dest-uri": f"http://127.0.0.1:{sink.port}/"})[0] == 201
        wait_until(lambda: count(api, "/", src) == 0 and len(sink.accepted) == 2, 20, "two delivered")
        assert drain(url, dlq) == ["r#0"]  # the one refused for good, dead-lettered, not dropped
        api.ok("DELETE", f"/api/parameters/shovel/%2F/{q(name)}")


# ---------------------------------------------------------------- failures
def test_unreachable_and_wrong_credentials_terminate_with_the_reason_without_a_hot_loop(
        pair: tuple[SkredProcess, SkredProcess]) -> None:
    a, b = pair
    api, _ = local(a)
    dead = f"amqp://guest:guest@127.0.0.1:{free_port()}/%2F"  # nothing listens there
    wrong = f"amqp://guest:nope@127.0.0.1:{b.port}/%2F"
    names = []
    for uri in (dead, wrong):
        name = unique("sh")
        names.append(name)
        assert put_shovel(api, "/", name, {"src-uri": uri, "src-queue": "x", "dest-uri": "amqp://",
                                           "dest-queue": unique("d"), "reconnect-delay": 1})[0] == 201
    for name, why in zip(names, ("Connect", "ACCESS_REFUSED"), strict=True):
        st = wait_state(api, "/", name, "terminated")
        assert why.lower() in st["reason"].lower() and "nope" not in st["reason"], st
    before = a.log_text().count("terminated:")
    time.sleep(2)  # the observation window: with back-off from 1 s, at most a few attempts each
    attempts = a.log_text().count("terminated:") - before
    assert attempts <= 6, f"{attempts} reconnect attempts in 2 s: a hot loop"
    assert api.get("/api/aliveness-test/%2F") == {"status": "ok"}
    for name in names:
        api.ok("DELETE", f"/api/parameters/shovel/%2F/{q(name)}")


ACK_WINDOW = 1.5  # seconds: a Skred source's ack_sync_interval (1 s default) + 0.5 s


def _kill_during(victim: SkredProcess, started: threading.Event) -> threading.Thread:
    def run() -> None:
        started.wait(30)
        victim.kill9()
        victim.start()
    t = threading.Thread(target=run)
    t.start()
    return t


@pytest.mark.chaos
@pytest.mark.timeout(180 + KILL_MESSAGES // 100)
@pytest.mark.parametrize("killed", ["destination", "source", "host"])
def test_kill9_during_an_on_confirm_shovel_loses_nothing(pair: tuple[SkredProcess, SkredProcess],
                                                         killed: str) -> None:
    """Skred -> Skred over AMQP: the shovel runs on ``a`` with a remote end on ``b``; kill -9 the
    remote end while messages move, or ``a`` itself (``host``: the shovel and its local
    destination, which publishes a turn's messages as one batch, killed mid-batch). Every
    confirmed message arrives (duplicates allowed: those in flight)."""
    a, b = pair
    api, url = local(a)
    src, dst, name = unique("src"), unique("dst"), unique("sh")
    n = KILL_MESSAGES
    if killed == "destination":  # local source on a, remote destination on b
        publish(url, src, "k", n, size=1024, declare={})
        value = {"src-uri": "amqp://", "src-queue": src, "dest-uri": remote_uri(b), "dest-queue": dst,
                 "reconnect-delay": 0.5, "src-prefetch-count": 200}
        src_api, dst_api, dst_url = api, Api(b.mgmt_port), b.url
    else:  # remote source on b, local destination on a
        publish(b.url, src, "k", n, size=1024, declare={})
        value = {"src-uri": remote_uri(b), "src-queue": src, "dest-uri": "amqp://", "dest-queue": dst,
                 "reconnect-delay": 0.5, "src-prefetch-count": 200}
        src_api, dst_api, dst_url = Api(b.mgmt_port), api, url
    victim = a if killed == "host" else b
    started = threading.Event()
    killer = _kill_during(victim, started)
    try:
        assert put_shovel(api, "/", name, value)[0] == 201
        wait_until(lambda: count(dst_api, "/", dst) >= n // 5, 60, "a fifth moved before the kill")
        # A killed source forgets the settlements of its last ack_sync_interval (1 s) + 0.5 s
        # (docs/reliability.md): those messages come again. Measure how many move in such a window.
        before = count(dst_api, "/", dst)
        time.sleep(ACK_WINDOW)
        recent = count(dst_api, "/", dst) - before
        started.set()
        killer.join(60)
        wait_until(lambda: http_ready(victim.mgmt_port), 20, "the killed broker back")
        wait_until(lambda: count(src_api, "/", src) == 0, 90, "the source drained after the kill")
        wait_state(api, "/", name, "running", 30)
    finally:
        started.set()
        killer.join(60)
    api.ok("DELETE", f"/api/parameters/shovel/%2F/{q(name)}")
    got = drain(dst_url, dst)
    missing = ids("k", n) - set(got)
    assert not missing, f"{len(missing)} of {n} confirmed messages lost, e.g. {sorted(missing)[:5]}"
    allowed = 2 * 200 + 10 + (2 * recent if killed == "source" else 0)  # in flight, + forgotten acks
    assert len(got) - n <= allowed, f"{len(got) - n} duplicates: more than the messages in flight"



# ---------------------------------------------------------------------- cluster
@pytest.mark.timeout(180)
def test_cluster_leader_kill9_moves_the_shovel_to_the_new_leader(cluster: Cluster) -> None:
    """A shovel defined through a follower runs on the leader; kill -9 the leader during an
    on-confirm move: the new leader runs it on from the last settled position, and nothing is
    lost. A follower's API shows the leader's shovels."""
    leader, followers = start_cluster(cluster)
    fapi = Api(followers[0].mgmt_port)
    fapi.base = f"http://{followers[0].ip}:{followers[0].mgmt_port}"
    wait_until(lambda: _http_up(fapi), 20, "the follower's management API")
    src, dst, name, n = unique("src"), unique("dst"), unique("sh"), 1000
    publish(followers[0].url, src, "c", n, size=1024, declare={})
    assert put_shovel(fapi, "/", name, {"src-uri": "amqp://", "src-queue": src, "dest-uri": "amqp://",
                                        "dest-queue": dst, "src-prefetch-count": 50})[0] == 201
    assert wait_state(fapi, "/", name, "running")["node"]  # the leader's shovel, seen on a follower
    wait_until(lambda: count(fapi, "/", dst) >= n // 10, 60, "a tenth moved before the kill")
    leader.kill9()

    def new_leader() -> ClusterNode | None:
        found = cluster.leader()
        return found if found is not None and found is not leader and found.answers() else None
    successor = wait_for(new_leader, 40, "a new leader serving clients")
    sapi = Api(successor.mgmt_port)
    sapi.base = f"http://{successor.ip}:{successor.mgmt_port}"
    wait_until(lambda: _http_up(sapi), 20, "the new leader's management API")
    wait_until(lambda: count(sapi, "/", src) == 0, 60, "the new leader's shovel drained the source")
    sapi.ok("DELETE", f"/api/parameters/shovel/%2F/{q(name)}")
    got = drain(successor.url, dst)
    missing = ids("c", n) - set(got)
    assert not missing, f"{len(missing)} of {n} lost across the leader's kill -9, e.g. {sorted(missing)[:5]}"


def _http_up(api: Api) -> bool:
    try:
        return api.call("GET", "/api/overview")[0] == 200
    except OSError:
        return False
