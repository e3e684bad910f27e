"""The conformance harness: every scenario against RabbitMQ 3.10 and Skred, transcripts diffed.

Each scenario runs three times on the Skred side (``_cluster_modes.MODES``): against a single
node, against a 3-node cluster's leader and through a follower (the session's cluster, booted once),
each diffed against the same RabbitMQ node.

A scenario passes when both brokers showed the client the same thing (after ``_wire``'s
normalisation and ``allowlist.FIELDS``). A scenario in ``allowlist.SCENARIOS`` must still differ
(a stale entry fails). A scenario that errors against RabbitMQ itself is a broken scenario and
fails. The terminal summary counts equal / allowlisted / different (conftest.py).
"""

from __future__ import annotations

import pytest

from .._cluster_modes import MODES
from . import (  # noqa: F401 - the scenario modules register their scenarios
    allowlist,
    scenarios_access,
    scenarios_basic,
    scenarios_connection,
    scenarios_topology,
)
from ._harness import TALLY, Target, compare
from ._steps import SCENARIOS as AMQP
from .scenarios_http import SCENARIOS as HTTP

# The first test also waits for RabbitMQ to boot (5-15 s idle, BOOT_DEADLINE under load).
pytestmark = [pytest.mark.timeout(180),
              pytest.mark.filterwarnings("ignore:This command is deprecated:DeprecationWarning")]

ALL = {**{f"amqp.{k}": v for k, v in AMQP.items()}, **{f"http.{k}": v for k, v in HTTP.items()}}


def test_allowlist_names_real_scenarios() -> None:
    assert set(allowlist.SCENARIOS) <= set(ALL), set(allowlist.SCENARIOS) - set(ALL)
    modes = set(allowlist.MODE_SCENARIOS)
    assert modes <= {(n, m) for n in ALL for m in MODES}, modes


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", sorted(ALL))
def test_scenario(name: str, mode: str, targets: tuple[Target, Target],
                  request: pytest.FixtureRequest) -> None:
    reference, skred = targets
    if mode != "single":
        node = request.getfixturevalue("session_cluster").target(mode)
        skred = Target("skred", node.host, node.port, node.mgmt_port)
    res = compare(ALL[name], reference, skred)
    assert res.reference_error is None, (
        f"scenario {name} fails against RabbitMQ itself: {res.reference_error}")
    reason = allowlist.SCENARIOS.get(name) or allowlist.MODE_SCENARIOS.get((name, mode))
    if reason is not None:
        TALLY["allowlisted"] += 1
        assert res.diff, f"{name} now agrees with RabbitMQ: remove its allowlist entry ({reason})"
        return
    TALLY["equal" if not res.diff else "different"] += 1
    assert not res.diff, f"{name}: Skred differs from RabbitMQ\n{res.report()}"
