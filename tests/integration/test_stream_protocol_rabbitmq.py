"""The rstream scenarios of ``test_stream_protocol.py`` against a private RabbitMQ 3.10 with its
``rabbitmq_stream`` plugin: the reference behaviour Skred's listener copies.

Each scenario is the same function Skred's tests run, handed a ``Target`` that points at the
RabbitMQ node. Where RabbitMQ 3.10 cannot run one (super streams are created over AMQP there:
the stream protocol's CreateSuperStream and single active consumers arrived in 3.11 and 3.13),
the test says so with ``xfail(strict=True)``, so a RabbitMQ that gains it is noticed; the
differences are listed in docs/compatibility.md. Without RabbitMQ installed the module skips,
unless ``SKRED_REQUIRE_RABBITMQ`` is set (CI), when it fails.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from . import test_stream_protocol as scenarios
from ._support import is_external
from .conformance._rabbit import RabbitProcess, require


class _Amqp:
    """What the scenarios' pika helpers read of a broker."""

    def __init__(self, rabbit: RabbitProcess) -> None:
        self.host = rabbit.host
        self.port = rabbit.port
        self.stream_port = rabbit.stream_port
        self.url = f"amqp://guest:guest@{rabbit.host}:{rabbit.port}/%2F"


@pytest.fixture(scope="module")
def rabbit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Amqp]:
    if is_external():
        pytest.skip("starts its own RabbitMQ")
    require()
    node = RabbitProcess(Path(tmp_path_factory.mktemp("rabbit-stream")), management=False, stream=True,
                         name="skredstream")
    try:
        node.spawn()
        problem = node.wait_ready()
        if problem:
            pytest.fail(problem)
        yield _Amqp(node)
    finally:
        node.close()


_SAME: list[Callable[..., None]] = [
    scenarios.test_publish_consume_round_trip_with_offsets_in_order,
    scenarios.test_offset_specs_next_last_offset_timestamp,
    scenarios.test_deduplication_by_producer_name_and_publishing_id,
    scenarios.test_store_and_query_offset_resume,
    scenarios.test_amqp_and_stream_clients_share_the_stream,
    scenarios.test_credit_bounds_chunks_in_flight,
    scenarios.test_permissions_and_bad_login,
]


@pytest.mark.parametrize("scenario", _SAME, ids=lambda f: f.__name__.removeprefix("test_"))
def test_same_scenario_on_rabbitmq(rabbit: _Amqp, scenario: Callable[..., None]) -> None:
    target = scenarios.Target(rabbit, "single")
    kwargs: dict[str, Any] = {"target": target}
    names = scenario.__code__.co_varnames[: scenario.__code__.co_argcount]
    if "shared_broker" in names:
        kwargs["shared_broker"] = rabbit
    if "broker_mode" in names:
        kwargs["broker_mode"] = "single"
    scenario(**kwargs)


@pytest.mark.xfail(strict=True, reason="RabbitMQ 3.10: no CreateSuperStream (3.13) nor single active "
                                       "consumers on super streams (3.11); docs/compatibility.md")
def test_super_streams_need_a_newer_rabbitmq(rabbit: _Amqp) -> None:
    scenarios.test_super_stream_routing_and_single_active_consumers(scenarios.Target(rabbit, "single"))
