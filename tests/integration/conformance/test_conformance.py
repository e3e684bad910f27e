"""The conformance harness: every scenario against RabbitMQ 3.10 and Skred, transcripts diffed.

Each scenario runs three times on the Skred side (``_cluster_modes.MODES``): against a single
node, against a 3-node cluster's leader and through a follower (the session's cluster, booted once),
each diffed against one run of it on the RabbitMQ node (``_harness.compare_modes``: the single
node's run beside the cluster's two, so three modes cost about two runs of wall time).

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
from ._harness import TALLY, Target, compare_modes
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


@pytest.mark.parametrize("name", sorted(ALL))
def test_scenario(name: str, targets: tuple[Target, Target], request: pytest.FixtureRequest) -> None:
    """One scenario against RabbitMQ once and Skred in every mode: the single node on one thread,
    the cluster's leader then its follower on another (they share the cluster's state)."""
    reference, single = targets
    cluster = request.getfixturevalue("session_cluster")
    skreds = {"single": single}
    for mode in MODES[1:]:
        node = cluster.target(mode)
        skreds[mode] = Target("skred", node.host, node.port, node.mgmt_port)
    results = compare_modes(ALL[name], reference, skreds, (("single",), tuple(MODES[1:])))
    problems = []
    for mode in MODES:
        res = results[mode]
        assert res.reference_error is None, (
            f"scenario {name} fails against RabbitMQ itself: {res.reference_error}")
        reason = allowlist.SCENARIOS.get(name) or allowlist.MODE_SCENARIOS.get((name, mode))
        if reason is not None:
            TALLY["allowlisted"] += 1
            if not res.diff:
                problems.append(f"{name} [{mode}] now agrees with RabbitMQ: remove its allowlist entry "
                                f"({reason})")
            continue
        TALLY["equal" if not res.diff else "different"] += 1
        if res.diff:
            problems.append(f"{name} [{mode}]: Skred differs from RabbitMQ\n{res.report()}")
    assert not problems, "\n\n".join(problems)
