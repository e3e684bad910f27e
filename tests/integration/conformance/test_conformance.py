"""The conformance harness: every scenario against RabbitMQ 3.10 and Skred, transcripts diffed.

Each scenario runs three times on the Skred side (``_cluster_modes.MODES``): against a single
node, against a 3-node cluster's leader and through a follower (the session's cluster, booted once),
each diffed against one run of it on the RabbitMQ node (``_harness.compare_modes``: the single
node's run beside the cluster's two, so three modes cost about two runs of wall time).

A representative subset (``ON_WORKERS``) also runs against a node of two worker processes
(``[main] workers = 2``): a connection lands on either worker and is handed to the owner of its
vhost, the management API answers for the whole node, and a client must not see any of it.

A scenario passes when both brokers showed the client the same thing (after ``_wire``'s
normalisation and ``allowlist.FIELDS``). A scenario in ``allowlist.SCENARIOS`` must still differ
(a stale entry fails). A scenario that errors against RabbitMQ itself is a broken scenario and
fails. The terminal summary counts equal / allowlisted / different (conftest.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .._cluster_modes import MODES
from .._support import SkredProcess, free_port
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
# against two workers too: the handshake and its refusals, several connections to one vhost,
# content, confirms, transactions, routing between queues, and the node-wide API lists
ON_WORKERS = ("amqp.conn_negotiate_and_close", "amqp.conn_wrong_password", "amqp.conn_unknown_vhost",
              "amqp.conn_frame_max_above_server", "amqp.conn_update_secret", "amqp.access_vhost_refused",
              "amqp.access_configure_write_read", "amqp.basic_publish_get_roundtrip",
              "amqp.basic_large_body_frames", "amqp.basic_mandatory_return_and_confirm",
              "amqp.confirm_sequence", "amqp.tx_commit_rollback", "amqp.direct_reply_to",
              "amqp.queue_exclusive_from_other_connection", "amqp.dead_letter_on_reject_with_x_death",
              "http.listings", "http.connections_channels_consumers", "http.pagination_and_sorting")


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


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    b = SkredProcess(tmp_path_factory.mktemp("conformance-workers") / "data",
                     ["--workers", "2", "--mgmt-metrics-port", str(free_port())])
    try:
        b.start()
        yield Target("skred", b.host, b.port, b.mgmt_port)
    finally:
        b.close()


@pytest.mark.parametrize("name", ON_WORKERS)
def test_scenario_on_two_workers(name: str, targets: tuple[Target, Target], two_workers: Target) -> None:
    """The scenario against RabbitMQ and a node of two workers: what the single node shows."""
    reference, _single = targets
    res = compare_modes(ALL[name], reference, {"workers": two_workers}, (("workers",),))["workers"]
    assert res.reference_error is None, f"{name} fails against RabbitMQ itself: {res.reference_error}"
    reason = allowlist.SCENARIOS.get(name) or allowlist.MODE_SCENARIOS.get((name, "single"))
    if reason is None:
        assert not res.diff, f"{name} [two workers]: Skred differs from RabbitMQ\n{res.report()}"
