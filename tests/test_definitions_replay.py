"""A vhost's definitions log at boot: what compaction writes replays without a refusal, and
topic bindings without wildcards cost no compiled pattern (no sockets: a VHost on a temporary
directory). Ten thousand MQTT sessions (a durable queue and a topic binding each) took 12 s to
replay on a loaded machine, a fifth of it logging a refused default-exchange binding per queue
that compaction had written, a quarter compiling an RE2 program per literal binding key."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from pamqp import frame as pframe

from broker.model import methods
from broker.model.definition_records import decode
from broker.model.exchange import topic_regex
from broker.model.vhost import VHost
from broker.patterns import Pattern
from broker.store.sink import NullSink


def _vhost(tmp: Path) -> VHost:
    return VHost("/", tmp / "data", segment_size=64 * 1024, sink=NullSink(), schedule=lambda cb: cb(),
                 mark_dirty=lambda _obj: None, transient_root=tmp / "transient")


def test_compacted_log_replays_without_refusals(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    vh = _vhost(tmp_path)
    for i in range(3):
        vh.declare_queue(f"mqtt-subscription-c{i}qos1", durable=True, owner=None)
        vh.bind_queue(f"mqtt-subscription-c{i}qos1", "amq.topic", f"sess.{i}", {}, owner=None)
    vh.compact()
    vh.definitions.close()
    exchanges = [getattr(decode(r), "exchange", None) for r in vh.definitions.load()]
    assert "" not in exchanges, "compaction wrote the default exchange's implicit bindings"
    with caplog.at_level(logging.WARNING, logger="broker.model.vhost"):
        again = _vhost(tmp_path)
    assert not [r for r in caplog.records if "definition record" in r.getMessage()]
    assert set(again.queues) == {f"mqtt-subscription-c{i}qos1" for i in range(3)}
    topic = again.exchanges["amq.topic"]
    assert sorted(k for _, k, _ in topic.bindings()) == ["sess.0", "sess.1", "sess.2"]
    assert again.exchanges[""].is_bound(again.queues["mqtt-subscription-c0qos1"], "mqtt-subscription-c0qos1")


def test_an_old_logs_default_exchange_bindings_are_skipped_quietly(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A log compacted before the fix holds them: the replay passes over them without a word."""
    vh = _vhost(tmp_path)
    vh.declare_queue("q", durable=True, owner=None)
    vh.definitions.append(pframe.marshal(methods.QueueBind(queue="q", exchange="", routing_key="q",
                                                            arguments={}), 0))
    vh.definitions.close()
    with caplog.at_level(logging.WARNING, logger="broker.model.vhost"):
        again = _vhost(tmp_path)
    assert not [r for r in caplog.records if "definition record" in r.getMessage()]
    assert "q" in again.queues


def test_literal_topic_keys_compile_no_pattern() -> None:
    assert not isinstance(topic_regex("sess.17"), Pattern)
    assert not isinstance(topic_regex("a.*x.b#"), Pattern)  # '*x' and 'b#' are words, not wildcards
    assert isinstance(topic_regex("sess.*"), Pattern) and isinstance(topic_regex("sess.#"), Pattern)
    assert topic_regex("sess.17").fullmatch(".sess.17") and not topic_regex("sess.17").fullmatch(".sess.1")
