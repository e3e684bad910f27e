"""Session fixtures of the conformance harness: one RabbitMQ node and one Skred, booted together.

Theory of operation: the RabbitMQ node (``_rabbit.RabbitProcess``) takes 5-15 s to boot, so it is
started once per test session and in parallel with the Skred broker (spawned first, then both
polled for readiness). Both brokers are private to the session: every port is free-bound, every
directory is under pytest's temp dir, and both are killed by PID/process group at the end.
Without RabbitMQ installed the harness skips with the reason, unless ``SKRED_REQUIRE_RABBITMQ``
is set (``.ci/run`` sets it): then it fails, so CI can never pass by skipping it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .._support import is_external
from ._harness import HIDDEN, HTTP_KEY_PATTERNS, TALLY, Target
from ._rabbit import RabbitProcess, booted_beside, require


@pytest.fixture(scope="session")
def targets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Target, Target]]:
    if is_external():
        pytest.skip("the conformance harness starts its own brokers")
    require()
    root = tmp_path_factory.mktemp("conformance")
    rabbit = RabbitProcess(root / "rabbitmq", mqtt=True)  # one node for the AMQP and MQTT harnesses
    with booted_beside(rabbit, root) as (skred,):
        yield (Target("rabbitmq", rabbit.host, rabbit.port, rabbit.mgmt_port, rabbit.mqtt_port or 0,
                      f"ws://{rabbit.host}:{rabbit.web_mqtt_port}/ws"),
               Target("skred", skred.host, skred.port, skred.mgmt_port, skred.mqtt_port,
                      f"ws://{skred.host}:{skred.mgmt_port}/ws/mqtt"))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if TALLY:
        terminalreporter.write_line(
            f"conformance vs RabbitMQ: {sum(TALLY.values())} scenarios, {TALLY['equal']} equal, "
            f"{TALLY['allowlisted']} allowlisted (deliberate), {TALLY['different']} different")
        idle = [p.pattern for p in HTTP_KEY_PATTERNS if not HIDDEN[p.pattern]]
        if idle and TALLY["different"] == 0 and sum(TALLY.values()) > 100:  # a whole run only
            terminalreporter.write_line(f"conformance: allowlist.HTTP_KEYS patterns that hid no "
                                        f"missing key (remove them?): {idle}")
