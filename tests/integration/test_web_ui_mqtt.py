"""MQTT sessions in the API and the web UI, in a real Chromium with real paho-mqtt clients.

Theory of operation: one broker and one browser for the module (test_web_ui.py's fixtures).
Three sessions are made by real clients: a persistent one that stays connected (two filters of
QoS 0 and 1, a will), a clean one, and a persistent one whose client subscribed and went away
(DISCONNECT: no will). ``GET /api/mqtt/sessions`` must list all three with what each holds,
and the UI's MQTT list and a session's page must show it. A user who is neither administrator
nor monitoring sees none of guest's sessions.
"""

from __future__ import annotations

import threading
import urllib.parse
import uuid
from collections.abc import Iterator
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from . import test_web_ui as ui
from ._support import Broker, wait_until
from .test_mqtt import Paho
from .test_web_ui import api, browser_errors, click, element, go, login, shot, wait

pytestmark = ui.pytestmark
browser = ui.browser  # the module's one Chromium (test_web_ui.py's fixture)

from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402


def _with_will(b: Broker, client_id: str, will_topic: str) -> mqtt.Client:
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=False,
                    protocol=mqtt.MQTTv311)
    c.username_pw_set("guest", "guest")
    c.will_set(will_topic, b"gone", qos=1, retain=True)
    done = threading.Event()
    subscribed = threading.Event()
    c.on_connect = lambda *_a: done.set()
    c.on_subscribe = lambda *_a: subscribed.set()
    c.connect(b.host, b.mqtt_port, keepalive=30)
    c.loop_start()
    assert done.wait(15), "no CONNACK"
    c.subscribe([("sensors/+/temp", 1), ("alerts/#", 0)])
    assert subscribed.wait(10), "no SUBACK"
    return c


@pytest.fixture(scope="module")
def sessions(shared_broker: Broker) -> Iterator[dict[str, Any]]:
    tag = uuid.uuid4().hex[:6]
    ids = {"live": f"ui-live-{tag}", "clean": f"ui-clean-{tag}", "away": f"ui-away-{tag}"}
    b = shared_broker
    away = Paho(b.host, b.mqtt_port, ids["away"], clean=False)
    assert not any(c.is_failure for c in away.subscribe("x/y", 1))
    away.c.disconnect()
    away.c.loop_stop()
    live = _with_will(b, ids["live"], f"status/{ids['live']}")
    clean = Paho(b.host, b.mqtt_port, ids["clean"], clean=True)
    clean.subscribe("a/b", 0)
    try:
        yield ids
    finally:
        for c in (live, clean.c):
            c.disconnect()
            c.loop_stop()
        # the persistent sessions go with a clean reconnect of their client ids
        for cid in (ids["live"], ids["away"]):
            Paho(b.host, b.mqtt_port, cid, clean=True).c.disconnect()


def _by_id(b: Broker) -> dict[str, dict[str, Any]]:
    return {s["client_id"]: s for s in api(b, "GET", "/api/mqtt/sessions")}


def test_the_api_lists_connected_clean_and_away_sessions(shared_broker: Broker,
                                                         sessions: dict[str, str]) -> None:
    b = shared_broker
    seen: dict[str, dict[str, Any]] = {}

    def three() -> bool:
        seen.update(_by_id(b))
        return all(i in seen for i in sessions.values()) and not seen[sessions["away"]]["connected"]

    wait_until(three, 10, "three MQTT sessions in the API")
    got = seen
    live, clean, away = (got[sessions[k]] for k in ("live", "clean", "away"))
    assert live["connected"] and not live["clean_session"] and live["vhost"] == "/"
    assert {(s["filter"], s["qos"]) for s in live["subscriptions"]} == {("sensors/+/temp", 1),
                                                                         ("alerts/#", 0)}
    assert live["will"] == {"topic": f"status/{sessions['live']}", "qos": 1, "retain": True,
                            "payload_bytes": 4, "delay": 0}
    assert live["user"] == "guest" and live["protocol_level"] == 4 and live["in_flight"] == 0
    assert clean["connected"] and clean["clean_session"] and clean["will"] is None
    assert [(s["filter"], s["qos"]) for s in clean["subscriptions"]] == [("a/b", 0)]
    assert not away["connected"] and not away["clean_session"]
    assert [(s["filter"], s["qos"]) for s in away["subscriptions"]] == [("x/y", 1)]
    one = api(b, "GET", f"/api/mqtt/sessions/%2F/{urllib.parse.quote(sessions['away'])}")
    assert one["client_id"] == sessions["away"] and one["subscription_count"] == 1
    assert {s["client_id"] for s in api(b, "GET", "/api/mqtt/sessions/%2F")} >= set(sessions.values())
    status, _ = ui_status(b, f"/api/mqtt/sessions/%2F/no-such-{uuid.uuid4().hex[:6]}")
    assert status == 404
    # a plain management user sees only its own sessions: none of guest's
    user = f"ui-mqtt-{uuid.uuid4().hex[:6]}"
    api(b, "PUT", f"/api/users/{user}", {"password": "pw", "tags": "management"})
    api(b, "PUT", f"/api/permissions/%2F/{user}", {"configure": ".*", "write": ".*", "read": ".*"})
    try:
        assert api(b, "GET", "/api/mqtt/sessions", user=user, password="pw") == []
    finally:
        api(b, "DELETE", f"/api/users/{user}")


def ui_status(b: Broker, path: str) -> tuple[int, Any]:
    try:
        return 200, api(b, "GET", path)
    except Exception as exc:  # noqa: BLE001 - test_web_ui.api raises the HTTP error
        return int(getattr(exc, "code", 0)), exc


def test_the_mqtt_pages_show_a_session_and_its_subscriptions(browser: WebDriver, shared_broker: Broker,
                                                             sessions: dict[str, str]) -> None:
    b = shared_broker
    login(browser, b)
    go(browser, b, "mqtt")
    wait(browser, "the sessions in the list", lambda d: all(i in d.find_element(By.ID, "main").text
                                                          for i in sessions.values()))
    shot(browser, "mqtt-sessions")
    click(browser, By.LINK_TEXT, sessions["live"])
    wait(browser, "the session's page", lambda d: "connected" in d.find_element(By.ID, "mqtt-details").text)
    details = element(browser, By.ID, "mqtt-details").text
    assert "persistent" in details and "not connected" not in details
    subs = element(browser, By.ID, "mqtt-subscriptions").text
    assert "sensors/+/temp" in subs and "alerts/#" in subs
    assert f"status/{sessions['live']}" in element(browser, By.ID, "mqtt-will").text
    shot(browser, "mqtt-session")
    go(browser, b, f"mqtt/%2F/{urllib.parse.quote(sessions['away'])}")
    wait(browser, "the away session's page",
         lambda d: "not connected" in d.find_element(By.ID, "mqtt-details").text)
    assert "x/y" in element(browser, By.ID, "mqtt-subscriptions").text
    assert "No will." in element(browser, By.ID, "mqtt-will").text
    assert browser_errors(browser) == []
