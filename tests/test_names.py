"""One rule for the names of users, vhosts, queues and exchanges (broker/auth/names.py): the user
and vhost stores and the management API refuse the same names with the same words; queue and
exchange names are as free as RabbitMQ makes them (control characters and NUL included)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _file_calls import worker_idle

from broker.auth.names import name_problem
from broker.auth.users import UserStore
from broker.auth.vhosts import VHostStore
from broker.http.common import ApiError, check_name
from broker.model.vhost import VHost
from broker.store.sink import NullSink


@pytest.mark.parametrize("bad,why", [("", "must not be empty"), ("é" * 128, "longer than 255 bytes"),
                                     ("a\x00b", "control characters"), ("a\x7fb", "control characters")])
def test_every_store_refuses_the_same_names(tmp_path: Path, bad: str, why: str) -> None:
    assert why in (name_problem("vhost", bad) or "")
    with pytest.raises(ValueError, match=why):
        VHostStore(tmp_path / "vhosts.json", NullSink()).add(bad)
    users = UserStore(tmp_path / "users.json", NullSink())
    with pytest.raises(ValueError, match=why):
        users.add_user(bad, "pw")
    with pytest.raises(ApiError):
        check_name("vhost", bad)
    if why == "control characters":  # RabbitMQ takes them in queue and exchange names
        assert check_name("queue", bad) == bad and check_name("exchange", bad) == bad
    else:
        with pytest.raises(ApiError):
            check_name("queue", bad)


def test_the_longest_name_and_unicode_are_accepted() -> None:
    assert name_problem("queue", "x" * 255) is None
    assert name_problem("queue", "ö" * 127) is None  # 254 bytes
    assert name_problem("queue", "ö" * 128) is not None


def test_queue_and_exchange_names_are_as_free_as_rabbitmqs() -> None:
    for name in ("ü", "a<b", "q'\"", "a/b", "%2F", "\U0001F600", "\x00", "a\nb", " ", "amq.x"):
        assert name_problem("queue", name) is None and name_problem("exchange", name) is None
    assert name_problem("user", "a\nb") is not None


HARD = ["ü", "a<b>", "q'\"", "a/b", "%2F", "\U0001F600", "nul\x00in", "a\nb", "x" * 255, "é" * 127]


def _vhost(tmp: Path) -> VHost:
    return VHost("/", tmp / "data", segment_size=64 * 1024, sink=NullSink(), schedule=lambda cb: cb(),
                 mark_dirty=lambda _obj: None, transient_root=tmp / "transient")


@pytest.mark.parametrize("compact", [False, True])
def test_any_name_goes_through_the_definitions_log_and_its_compaction(tmp_path: Path, compact: bool) -> None:
    """pamqp's name grammar once made every such declare fail after the queue was in memory."""
    vh = _vhost(tmp_path)
    for name in HARD:
        vh.declare_exchange(name, "topic", durable=True)
        vh.declare_queue(name, durable=True, owner=None)
        vh.bind_queue(name, name, name[:10], {}, owner=None)
    if compact:
        vh.compact()
    vh.close()
    again = _vhost(tmp_path)
    assert set(again.queues) == set(HARD)
    assert set(HARD) <= set(again.exchanges)
    for name in HARD:
        assert again.exchanges[name].is_bound(again.queues[name], name[:10], {})
    assert {(d / ".queue").read_bytes().decode() for d in again.dir.iterdir() if d.is_dir()} == set(HARD)
    again.close()


def test_a_cut_log_and_unlogged_undo_leave_the_state_before(tmp_path: Path) -> None:
    """How a definitions import that failed half-way is taken back (broker/http/definitions.py)."""
    vh = _vhost(tmp_path)
    vh.declare_queue("kept", durable=True, owner=None)
    mark = vh.definitions.size()
    vh.declare_exchange("gone-x", "direct", durable=True)
    vh.declare_queue("gone-q", durable=True, owner=None)
    vh.bind_queue("gone-q", "gone-x", "k", {}, owner=None)
    with vh.unlogged():
        vh.delete_queue("gone-q", owner=None)
        vh.delete_exchange("gone-x")
    vh.definitions.cut(mark)
    assert vh.definitions.size() == mark
    vh.close()
    again = _vhost(tmp_path)
    assert set(again.queues) == {"kept"} and "gone-x" not in again.exchanges
    again.close()


def test_a_declare_the_log_refuses_for_any_reason_leaves_nothing(tmp_path: Path) -> None:
    """Not only DiskFull: any failure to log a durable declare takes it back (queue, store,
    exchange, binding), so no queue lives on in memory to confirm messages a restart loses."""
    vh = _vhost(tmp_path)
    vh.declare_exchange("x", "direct", durable=True)
    vh.declare_queue("q", durable=True, owner=None)
    vh.definitions.close()
    vh.definitions.path.unlink()
    vh.definitions.path.mkdir()  # a real failure that is not ENOSPC: the log cannot be opened
    before = sorted(p.name for p in vh.dir.iterdir())
    with pytest.raises(OSError):
        vh.declare_queue("new-q", durable=True, owner=None)
    with pytest.raises(OSError):
        vh.declare_exchange("new-x", "fanout", durable=True)
    with pytest.raises(OSError):
        vh.bind_queue("q", "x", "k", {}, owner=None)
    assert "new-q" not in vh.queues and "new-x" not in vh.exchanges
    assert not vh.exchanges["x"].is_bound(vh.queues["q"], "k", {})
    # the taken-back queue's directory is a tombstone the segment worker removes (off the loop)
    worker_idle()
    assert sorted(p.name for p in vh.dir.iterdir()) == before
