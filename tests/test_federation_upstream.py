"""The federation parameters and the rules of a link that need no socket: validation of
``federation-upstream``/``federation-upstream-set``, what a policy resolves to, the upstream
queue's name, and the per-vhost parameters store."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from broker.auth.parameters import RuntimeParameters
from broker.federation import supervisor
from broker.federation.exchange_link import queue_name
from broker.federation.upstream import check_upstream, check_upstream_set, resolve, scrub
from broker.store.sink import NullSink


@pytest.mark.parametrize("value, words", [
    ({"uri": "amqp://h", "prefetch": 1}, "unknown key 'prefetch'"),
    ({"uri": "amqp://h", "max-hops": 0}, "'max-hops' must be at least 1"),
    ({"uri": "amqp://h", "max-hops": True}, "wrong type"),
    ({"uri": "amqp://h", "reconnect-delay": 0}, "reconnect-delay"),
    ({"uri": "amqp://h", "expires": 0}, "expires"),
    ({"uri": "amqp://h", "message-ttl": -1}, "message-ttl"),
    ({"uri": ["amqp://h"] * 17}, "1 to 16"),
    ({"uri": "amqp:/x"}, "scheme"),
    ({"uri": "amqp://user@/v"}, "needs a host"),
    ({"uri": "amqps://u:pw@/v"}, "needs a host"),
    ({"uri": "mqtt://h"}, "scheme"),
    ({"uri": 5}, "'uri' must be"),
])
def test_bad_upstreams_are_refused_with_the_reason(value: object, words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        check_upstream(value)


def test_password_never_shown() -> None:
    with pytest.raises(ValueError) as info:
        check_upstream({"uri": "ftp://user:hunter2@h/"})
    assert "hunter2" not in str(info.value)
    assert scrub("amqp://user:hunter2@h:5672/v") == "amqp://user@h:5672/v"


def test_sets_and_policies_resolve() -> None:
    ups = {"a": {"uri": "amqp://a", "max-hops": 2}, "b": {"uri": ["amqp://b1", "amqp://b2"]}}
    sets = {"s": check_upstream_set([{"upstream": "b", "prefetch-count": 7}, {"upstream": "gone"}])}
    found, why = resolve({"federation-upstream": "a"}, ups, sets)
    assert [(u.name, u.max_hops, u.uris) for u in found] == [("a", 2, ("amqp://a",))] and why is None
    found, why = resolve({"federation-upstream-set": "all"}, ups, sets)
    assert [u.name for u in found] == ["a", "b"] and why is None
    found, why = resolve({"federation-upstream-set": "s"}, ups, sets)
    assert [(u.name, u.prefetch_count, u.uris) for u in found] == [("b", 7, ("amqp://b1", "amqp://b2"))]
    assert why is not None and "gone" in why
    assert resolve({"federation-upstream": "nope"}, ups, sets) == ([], "no federation upstream 'nope'")
    with pytest.raises(ValueError, match="upstream"):
        check_upstream_set([{"prefetch-count": 1}])


def test_host_less_uris_name_this_broker() -> None:
    from broker.federation.upstream import local_vhost
    assert check_upstream({"uri": ["amqp://", "amqp:///v%2F1"]})
    assert local_vhost("amqp://", "own") == "own"
    assert local_vhost("amqp:///v%2F1", "own") == "v/1"
    assert local_vhost("amqp://h/v", "own") is None


def test_upstream_queue_name_stays_in_the_name_grammar() -> None:
    assert queue_name("x", "x", "rabbit@h", "/") == "federation: x - rabbit@h"
    assert queue_name("x", "up", "c", "v(1)") == "federation: up - c v_1_ x"


def test_parameters_store_components_persistence_and_vhosts(tmp_path: Path) -> None:
    path = tmp_path / "parameters.json"
    store = RuntimeParameters(path, NullSink())
    changes: list[int] = []
    store.watch(lambda *_: changes.append(1))
    with pytest.raises(ValueError, match="component 'federation-upstream' not found"):
        store.put("federation-upstream", "/", "u", {"uri": "amqp://h"})
    supervisor.register(store)
    assert store.put("federation-upstream", "/", "u", {"uri": "amqp://h"}) is True
    assert store.put("federation-upstream", "/", "u", {"uri": "amqp://h2"}) is False
    store.put("federation-upstream", "v", "u", {"uri": "amqp://h"})
    with pytest.raises(ValueError):
        store.put("federation-upstream", "/", "bad", {"uri": "amqp://h", "x": 1})
    again = RuntimeParameters(path, NullSink())  # read back from the file
    assert again.list("federation-upstream", "/") == [
        {"name": "u", "vhost": "/", "component": "federation-upstream", "value": {"uri": "amqp://h2"}}]
    store.clear_vhost("v")
    assert [p["vhost"] for p in store.list()] == ["/"]
    assert store.delete("federation-upstream", "/", "u") and not store.delete("federation-upstream", "/", "u")
    assert len(changes) == 5


def test_links_speak_amqp_through_the_link_layer_not_a_client_library() -> None:
    """Federation and shovel links read and write AMQP on ``broker/links/`` (deliveries taken in
    place, a turn's publishes at once): importing every link module loads no aiormq."""
    root = Path(__file__).resolve().parent.parent
    code = ("import sys, broker.federation.exchange_link, broker.federation.queue_link, "
            "broker.shovel.manager; print('aiormq' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(root)}, cwd=root)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
