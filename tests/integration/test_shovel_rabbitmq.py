"""Shovels between Skred and a real RabbitMQ 3.10 (Debian's ``rabbitmq-server`` with its own
``rabbitmq_shovel`` plugin), both on loopback: Skred's shovel from RabbitMQ and to it, and
RabbitMQ's shovel plugin pointed at Skred in both directions. One RabbitMQ and one Skred per
module; CI installs RabbitMQ (``.ci/run``) and sets ``SKRED_REQUIRE_RABBITMQ``, so it never skips.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ._shovel import count, drain, ids, publish, put_shovel, q, wait_state
from ._support import SkredProcess, is_external, unique, wait_until
from .conformance._rabbit import RabbitProcess, booted_beside, require
from .test_mgmt_api import Api

pytestmark = pytest.mark.skipif(is_external(), reason="starts brokers of its own")


@pytest.fixture(scope="module")
def brokers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RabbitProcess, SkredProcess]]:
    require()
    root = tmp_path_factory.mktemp("shovel-rabbit")
    rabbit = RabbitProcess(root / "rabbitmq", name="skredshovel",
                           plugins=("rabbitmq_shovel", "rabbitmq_shovel_management"))
    with booted_beside(rabbit, root) as (skred,):
        yield rabbit, skred


def rabbit_url(r: RabbitProcess) -> str:
    return f"amqp://guest:guest@127.0.0.1:{r.port}/%2F"


def skred_url(s: SkredProcess) -> str:
    return f"amqp://guest:guest@127.0.0.1:{s.port}/%2F"


def test_skred_shovels_from_rabbitmq(brokers: tuple[RabbitProcess, SkredProcess]) -> None:
    rabbit, skred = brokers
    api = Api(skred.mgmt_port)
    src, dst, name = unique("rsrc"), unique("dst"), unique("sh")
    publish(rabbit_url(rabbit), src, "r", 500, size=1024, declare={})
    assert put_shovel(api, "/", name, {"src-uri": rabbit_url(rabbit), "src-queue": src, "dest-uri": "amqp://",
                                       "dest-queue": dst, "reconnect-delay": 1})[0] == 201
    wait_until(lambda: count(api, "/", dst) == 500, 60, "500 moved from RabbitMQ")
    wait_state(api, "/", name, "running")
    api.ok("DELETE", f"/api/parameters/shovel/%2F/{q(name)}")
    assert sorted(drain(skred.url, dst)) == sorted(ids("r", 500))
    assert drain(rabbit_url(rabbit), src) == []  # acked at RabbitMQ, nothing left behind


def test_skred_shovels_to_rabbitmq(brokers: tuple[RabbitProcess, SkredProcess]) -> None:
    rabbit, skred = brokers
    api = Api(skred.mgmt_port)
    src, dst, name = unique("src"), unique("rdst"), unique("sh")
    publish(skred.url, src, "s", 500, size=1024, declare={})
    assert put_shovel(api, "/", name, {"src-uri": "amqp://", "src-queue": src, "dest-uri": rabbit_url(rabbit),
                                       "dest-queue": dst, "reconnect-delay": 1})[0] == 201
    wait_until(lambda: count(api, "/", src) == 0, 60, "500 moved to RabbitMQ")
    api.ok("DELETE", f"/api/parameters/shovel/%2F/{q(name)}")
    assert sorted(drain(rabbit_url(rabbit), dst)) == sorted(ids("s", 500))


def test_rabbitmq_shovel_plugin_pointed_at_skred(brokers: tuple[RabbitProcess, SkredProcess]) -> None:
    """RabbitMQ's own plugin moves RabbitMQ -> Skred and Skred -> RabbitMQ."""
    rabbit, skred = brokers
    assert rabbit.mgmt_port is not None
    rapi = Api(rabbit.mgmt_port)
    sapi = Api(skred.mgmt_port)
    to_skred, from_skred = unique("to"), unique("from")
    publish(rabbit_url(rabbit), to_skred, "a", 200, declare={})
    publish(skred.url, from_skred, "b", 200, declare={})
    for name, value in ((to_skred, {"src-uri": "amqp://", "src-queue": to_skred,
                                    "dest-uri": skred_url(skred), "dest-queue": to_skred}),
                        (from_skred, {"src-uri": skred_url(skred), "src-queue": from_skred,
                                      "dest-uri": "amqp://", "dest-queue": from_skred})):
        full = {"src-protocol": "amqp091", "dest-protocol": "amqp091", **value}
        status, body, _ = rapi.call("PUT", f"/api/parameters/shovel/%2F/{q(name)}", {"value": full})
        assert status in (201, 204), body
    wait_until(lambda: count(sapi, "/", to_skred) == 200, 60, "RabbitMQ's plugin moved 200 into Skred")
    wait_until(lambda: count(sapi, "/", from_skred) == 0, 60, "RabbitMQ's plugin drained Skred's queue")
    for name in (to_skred, from_skred):
        rapi.call("DELETE", f"/api/parameters/shovel/%2F/{q(name)}")
    assert sorted(drain(skred.url, to_skred)) == sorted(ids("a", 200))
    wait_until(lambda: count(rapi, "/", from_skred) == 200, 30, "Skred's 200 at RabbitMQ")
    assert sorted(drain(rabbit_url(rabbit), from_skred)) == sorted(ids("b", 200))
