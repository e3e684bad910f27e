"""One rule for the names of users, vhosts, queues and exchanges (broker/auth/names.py): the user
and vhost stores and the management API refuse the same names with the same words; queue and
exchange names are as free as RabbitMQ makes them (control characters and NUL included)."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker.auth.names import name_problem
from broker.auth.users import UserStore
from broker.auth.vhosts import VHostStore
from broker.http.common import ApiError, check_name
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
