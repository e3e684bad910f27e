"""The MQTT conformance harness: each scenario against Skred, mosquitto 2.0 and RabbitMQ 3.10.

Theory of operation: a scenario of ``scenarios_mqtt`` runs at each MQTT version it names against
the references (mosquitto for 3.1.1 and 5; RabbitMQ's ``rabbitmq_mqtt``, the conformance session's
node with the plugin enabled, for 3.1.1 only) and against Skred in every ``_cluster_modes`` mode:
a single node, a 3-node cluster's leader and through a follower. The references and the single
node run at once on threads; the leader and the follower one after the other on another thread
(they share the cluster's state). What holds:

- Skred's single node differs from a reference exactly where ``allowlist.MQTT`` says, each entry
  a deliberate difference listed in docs/compatibility.md; an entry whose scenario has come to
  agree fails, so the list never outlives the difference.
- the cluster's leader and follower show a client what the single node shows.
- a scenario that errors against a reference is a broken scenario and fails.

Over WebSocket (``test_mqtt_over_websocket``) every 3.1.1 scenario runs against RabbitMQ's
``rabbitmq_web_mqtt`` (the same node, path ``/ws``) and Skred's management port (``/ws/mqtt``) at
once: Skred differs from RabbitMQ there exactly where it does over TCP (``allowlist.MQTT``) and
where ``allowlist.WEB_MQTT`` says (a difference of the WebSocket listener), each in
docs/compatibility.md.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from .._cluster_modes import MODES
from .._support import is_external
from . import allowlist
from ._harness import Target
from ._mosquitto import MosquittoProcess, missing
from ._mqtt_wire import MRun
from .scenarios_mqtt import MQTT_SCENARIOS

pytestmark = pytest.mark.timeout(180)  # the first test also waits for RabbitMQ to boot
CASES = sorted((name, v) for name, (_, versions) in MQTT_SCENARIOS.items() for v in versions)
COMPAT = Path(__file__).parents[3] / "docs" / "compatibility.md"


@pytest.fixture(scope="module")
def mosquitto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MosquittoProcess]:
    if is_external():
        pytest.skip("the conformance harness starts its own brokers")
    why = missing()
    if why:
        if os.environ.get("CI") or os.environ.get("SKRED_REQUIRE_RABBITMQ"):
            pytest.fail(why)  # .ci/run installs it: CI never passes by skipping
        pytest.skip(why)
    m = MosquittoProcess(tmp_path_factory.mktemp("mosquitto"))
    try:
        m.start()
        yield m
    finally:
        m.close()


def run(name: str, broker: str, host: str, port: int, version: int, url: str = "") -> MRun:
    r = MRun(broker, host, port, version, url)
    try:
        MQTT_SCENARIOS[name][0](r)
    except Exception as exc:  # noqa: BLE001 - the failure is the observation, diffed like others
        r.log(("error", type(exc).__name__, str(exc)[:200]))
    finally:
        r.close()
    return r


def render(r: MRun) -> list[str]:
    return [repr(rec) for rec in r.transcript]


def diff(a: MRun, b: MRun) -> str:
    ra, rb = render(a), render(b)
    return "" if ra == rb else "\n".join(difflib.unified_diff(ra, rb, a.broker, b.broker, lineterm="", n=2))


def test_mqtt_allowlist_names_real_cases_and_is_documented() -> None:
    real = {(n, v, ref) for n, v in CASES for ref in ("mosquitto", "rabbitmq")
            if ref == "mosquitto" or v == 4}
    assert set(allowlist.MQTT) <= real, set(allowlist.MQTT) - real
    assert set(allowlist.WEB_MQTT) <= {n for n, v in CASES if v == 4}, set(allowlist.WEB_MQTT)
    doc = COMPAT.read_text()
    undocumented = [f"{n} (MQTT {'5' if v == 5 else '3.1.1'}, {ref})" for n, v, ref in allowlist.MQTT
                    if not re.search(rf"`{re.escape(n)}`", doc)]
    undocumented += [f"{n} (MQTT over WebSocket)" for n in allowlist.WEB_MQTT
                     if not re.search(rf"`{re.escape(n)}` over WebSocket", doc)]
    assert not undocumented, f"docs/compatibility.md does not name: {undocumented}"


@pytest.mark.parametrize("name,version", CASES, ids=[f"{n}-v{'5' if v == 5 else '311'}" for n, v in CASES])
def test_mqtt_scenario(name: str, version: int, targets: tuple[Target, Target], mosquitto: MosquittoProcess,
                       request: pytest.FixtureRequest) -> None:
    rabbit, single = targets
    cluster = request.getfixturevalue("session_cluster")
    refs = {"mosquitto": (mosquitto.host, mosquitto.port)}
    if version == 4:
        refs["rabbitmq"] = (rabbit.host, rabbit.mqtt_port)
    nodes = {m: cluster.target(m).node for m in MODES[1:]}
    with ThreadPoolExecutor(len(refs) + 2) as pool:
        ref_runs = {k: pool.submit(run, name, k, h, p, version) for k, (h, p) in refs.items()}
        single_run = pool.submit(run, name, "skred", single.host, single.mqtt_port, version)
        cluster_runs = pool.submit(lambda: {m: run(name, f"skred-{m}", n.ip, n.mqtt_port, version)
                                            for m, n in nodes.items()})
        got = {k: f.result() for k, f in ref_runs.items()}
        mine, modes = single_run.result(), cluster_runs.result()
    problems = []
    for ref, r in got.items():
        last = r.transcript[-1] if r.transcript else ()
        assert not last or last[0] != "error", f"scenario {name} fails against {ref} itself: {last}"
        d = diff(r, mine)
        reason = allowlist.MQTT.get((name, version, ref))
        if reason and not d:
            problems.append(f"{name} v{version} now agrees with {ref}: remove its allowlist entry ({reason})")
        elif d and not reason:
            problems.append(f"{name} v{version}: Skred differs from {ref}\n{d}")
    for mode, r in modes.items():
        if render(r) != render(mine):
            problems.append(f"{name} v{version}: the cluster's {mode} differs from a single node\n"
                            f"{diff(mine, r)}")
    assert not problems, "\n\n".join(problems)


WEB_CASES = [name for name, v in CASES if v == 4]


@pytest.mark.parametrize("name", WEB_CASES)
def test_mqtt_over_websocket(name: str, targets: tuple[Target, Target]) -> None:
    rabbit, single = targets
    with ThreadPoolExecutor(2) as pool:
        theirs = pool.submit(run, name, "rabbitmq-ws", rabbit.host, 0, 4, rabbit.mqtt_ws_url)
        mine = pool.submit(run, name, "skred-ws", single.host, 0, 4, single.mqtt_ws_url).result()
        ref = theirs.result()
    last = ref.transcript[-1] if ref.transcript else ()
    assert not last or last[0] != "error", f"scenario {name} fails against rabbitmq_web_mqtt itself: {last}"
    d = diff(ref, mine)
    reason = allowlist.WEB_MQTT.get(name) or allowlist.MQTT.get((name, 4, "rabbitmq"))
    if reason:
        assert d, f"{name} over WebSocket now agrees with rabbitmq_web_mqtt: remove its entry ({reason})"
    else:
        assert not d, f"{name} over WebSocket: Skred differs from rabbitmq_web_mqtt\n{d}"
