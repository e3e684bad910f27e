"""Policies applied live to a VHost (no sockets): precedence, live changes, persistence."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from broker import errors
from broker.model import features
from broker.model.publish import PublishRequest
from broker.model.vhost import VHost
from broker.store.sink import NullSink


class _Timer:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def _vhost(tmp: Path) -> VHost:
    def call_later(delay: float, cb: Callable[[], None]) -> _Timer:
        return _Timer()

    return VHost("/", tmp / "data", segment_size=64 * 1024, sink=NullSink(),
                 schedule=lambda cb: cb(), mark_dirty=lambda _obj: None,
                 transient_root=tmp / "transient", call_later=call_later)


def _publish(vh: VHost, q: str, n: int, start: int = 0) -> None:
    queue = vh.queues[q]
    for i in range(start, start + n):
        queue.publish(features.now_ms(), b"", q.encode(), b"\x00\x00", b"%d" % i, False)


def _bodies(vh: VHost, q: str) -> list[bytes]:
    out = []
    queue = vh.queues[q]
    while (got := queue.get()) is not None:
        queue.ack(got[0])
        out.append(got[4])
    return out


def test_policy_applies_live_and_is_removed(tmp_path: Path) -> None:
    vh = _vhost(tmp_path)
    vh.declare_queue("orders", owner=None)
    vh.declare_queue("other", owner=None)
    _publish(vh, "orders", 5)
    assert vh.queues["orders"].features is None  # plain until a policy applies
    vh.set_policy("cap", "^ord", {"max-length": 3}, priority=0, apply_to="queues")
    assert vh.queues["orders"].message_count == 3  # trimmed from the head at once
    assert vh.queues["other"].features is None
    vh.set_policy("cap", "^ord", {"max-length": 1})  # changed
    assert vh.queues["orders"].message_count == 1
    assert vh.delete_policy("cap")
    _publish(vh, "orders", 3, start=10)
    assert _bodies(vh, "orders") == [b"4", b"10", b"11", b"12"]
    assert not vh.delete_policy("cap")


def test_precedence_stricter_limit_wins_and_priority(tmp_path: Path) -> None:
    vh = _vhost(tmp_path)
    q, _ = vh.declare_queue("q1", owner=None, arguments={"x-max-length": 5,
                                                          "x-dead-letter-exchange": "argdlx"})
    vh.set_policy("low", ".*", {"max-length": 10, "dead-letter-exchange": "poldlx"}, priority=1)
    assert q.features is not None
    assert q.features.cfg.max_length == 5 and q.features.cfg.dlx == "argdlx"
    vh.set_policy("high", "q", {"max-length": 2, "message-ttl": 1000}, priority=5)
    assert q.features.cfg.max_length == 2 and q.features.cfg.message_ttl == 1000
    vh.set_policy("op", ".*", {"max-length": 1}, operator=True)
    assert q.features.cfg.max_length == 1
    assert [p["name"] for p in vh.policies()] == ["high", "low"]
    assert [p["name"] for p in vh.policies(operator=True)] == ["op"]


def test_policies_persist_and_validate(tmp_path: Path) -> None:
    vh = _vhost(tmp_path)
    vh.set_policy("ttl", "^t", {"message-ttl": 500, "ha-mode": "all"}, apply_to="queues")
    with pytest.raises(ValueError):
        vh.set_policy("bad", "^t", {"max-priority": 5})
    with pytest.raises(ValueError):
        vh.set_policy("bad", "(", {"max-length": 1})
    with pytest.raises(ValueError):
        vh.set_policy("bad", "x", {"max-length": -1})
    with pytest.raises(ValueError):
        vh.set_policy("bad", "x", {"max-length": 1}, apply_to="nothing")
    vh.close()
    vh2 = _vhost(tmp_path)
    assert [(p["name"], p["definition"]["message-ttl"]) for p in vh2.policies()] == [("ttl", 500)]
    q, _ = vh2.declare_queue("tq", owner=None)
    assert q.features is not None and q.features.cfg.message_ttl == 500


def test_alternate_exchange_by_policy(tmp_path: Path) -> None:
    vh = _vhost(tmp_path)
    vh.declare_exchange("ae", "fanout")
    ex = vh.declare_exchange("main", "direct")
    vh.declare_queue("catch", owner=None)
    vh.bind_queue("catch", "ae", "", {}, owner=None)
    vh.set_policy("ae", "^main$", {"alternate-exchange": "ae"}, apply_to="exchanges")
    assert [q.name for q in vh.publish(PublishRequest(ex.name, "nobody", b"\x00\x00", b"m", 0)).queues] \
        == ["catch"]
    vh.delete_policy("ae")
    assert vh.publish(PublishRequest(ex.name, "nobody", b"\x00\x00", b"m", 0)).unroutable


@pytest.mark.parametrize("args", [{"x-max-priority": 256}, {"x-expires": 0}, {"x-overflow": 1},
                                  {"x-single-active-consumer": "yes"}])
def test_bad_arguments(tmp_path: Path, args: dict[str, Any]) -> None:
    vh = _vhost(tmp_path)
    with pytest.raises(errors.PreconditionFailed):
        vh.declare_queue("bad", owner=None, arguments=args)
    assert "bad" not in vh.queues


def test_priority_of_raw_props() -> None:
    from pamqp import commands

    from broker.amqp import codec

    for kw in ({"priority": 7}, {"priority": 3, "content_type": "a/b", "headers": {"x": 1},
                                 "delivery_mode": 2}, {}):
        props = codec.encode_properties(commands.Basic.Properties(**kw))
        assert features.priority_of(props) == kw.get("priority", 0)
