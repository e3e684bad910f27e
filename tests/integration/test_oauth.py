"""OAuth 2 / OpenID Connect access tokens, end to end: a real provider over HTTP, a real broker.

Theory of operation: one provider (``_oidc_provider.Provider``: discovery, JWKS, login page,
authorization-code flow with PKCE, tokens signed with authlib's JOSE) and one broker with
``auth_backends = internal, oauth`` serve the whole module. The broker finds the provider's keys
by discovery at start; tests mint tokens with the claims they need and present them as real
clients do: pika (the PLAIN password, connection.update-secret), paho-mqtt 5 (the password),
HTTP (``Authorization: Bearer`` on the management API, basic auth on LMQ). Waits poll with
deadlines. The browser login (Chromium) is in ``test_oauth_ui.py``.
"""

from __future__ import annotations

import base64
import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import paho.mqtt.client as mqtt
import pika
import pytest

from ._oidc_provider import Provider
from ._support import SkredProcess, is_external, wait_until
from .test_web_ui import By, WebDriver, browser, click, element, wait  # noqa: F401 - browser: test_web_ui's fixture

pytestmark = pytest.mark.skipif(is_external(), reason="configures Skred's auth backends")

def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


SCOPES_ALL = ("skred.configure:%2F/*", "skred.write:%2F/*", "skred.read:%2F/*")
ADMIN = (*SCOPES_ALL, "skred.tag:administrator")


@pytest.fixture(scope="module")
def provider() -> Iterator[Provider]:
    p = Provider().start()
    try:
        yield p
    finally:
        p.stop()


def oauth_args(p: Provider) -> list[str]:
    return ["--auth-backends", "internal,oauth", "--oauth-issuer", p.issuer,
            "--oauth-resource-server-id", "skred", "--oauth-leeway", "1",
            "--oauth-jwks-min-refresh", "2", "--oauth-client-id", p.client_id,
            # the refusals tested here would otherwise slow the logins after them (not under test)
            "--login-throttle-free", "1000"]


@pytest.fixture(scope="module")
def sso(provider: Provider, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SkredProcess]:
    b = SkredProcess(tmp_path_factory.mktemp("oauth") / "data", oauth_args(provider))
    try:
        b.start()
        yield b
    finally:
        b.close()


def amqp(b: SkredProcess, token: str, user: str = "ignored") -> pika.BlockingConnection:
    creds = pika.PlainCredentials(user, token, erase_on_connect=False)
    return pika.BlockingConnection(pika.ConnectionParameters(
        b.host, b.port, "/", creds, connection_attempts=1, blocked_connection_timeout=10))


def api(b: SkredProcess | None, path: str, auth: str, method: str = "GET", body: Any = None,
        port: int | None = None, host: str = "") -> tuple[int, Any]:
    where = f"{host}:{port}" if b is None else f"{b.host}:{port or b.mgmt_port}"
    req = urllib.request.Request(f"http://{where}{path}", method=method,
                                 data=None if body is None else (body if isinstance(body, bytes)
                                                                 else json.dumps(body).encode()),
                                 headers={"Authorization": auth, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    try:
        return status, json.loads(raw) if raw else None
    except ValueError:
        return status, raw


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


# ------------------------------------------------------------------ AMQP
def test_token_logs_in_with_its_scopes(sso: SkredProcess, provider: Provider) -> None:
    q = unique("oq")
    token = provider.token("alice", ("skred.configure:%2F/oq-*", "skred.write:%2F/amq.default",
                                     "skred.read:%2F/oq-*"))
    conn = amqp(sso, token)
    try:
        ch = conn.channel()
        ch.queue_declare(q)
        ch.basic_publish("", q, b"hello")
        wait_until(lambda: ch.basic_get(q, auto_ack=True)[2] == b"hello", 10, "the message back")
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
            ch.queue_declare(unique("other"))  # configure only on oq-*
        assert refused.value.reply_code == 403
        ch = conn.channel()
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
            ch.exchange_declare(unique("ex"))
        assert refused.value.reply_code == 403
        # the connection is alice's, whatever user name the client sent
        status, conns = api(sso, "/api/connections", basic("guest", "guest"))
        assert status == 200 and any(c["user"] == "alice" for c in conns)
    finally:
        conn.close()


def test_es256_token(sso: SkredProcess, provider: Provider) -> None:
    conn = amqp(sso, provider.token("erin", SCOPES_ALL, kid="ec-1"))
    conn.channel().queue_declare(unique("es"), auto_delete=True)
    conn.close()


def _refused(sso: SkredProcess, token: str) -> None:
    with pytest.raises((pika.exceptions.ProbableAuthenticationError, pika.exceptions.AuthenticationError)):
        amqp(sso, token).close()
    assert api(sso, "/api/whoami", f"Bearer {token}")[0] == 401


@pytest.mark.parametrize("case", ["expired", "not_yet_valid", "wrong_audience", "wrong_issuer",
                                  "wrong_key", "no_kid", "hs256", "no_username"])
def test_bad_tokens_are_refused(sso: SkredProcess, provider: Provider, case: str) -> None:
    from joserfc.jwk import OctKey, RSAKey
    make = {
        "expired": lambda: provider.token("bob", ADMIN, lifetime=-30),
        "not_yet_valid": lambda: provider.token("bob", ADMIN, nbf_in=60),
        "wrong_audience": lambda: provider.token("bob", ADMIN, aud="someone-else"),
        "wrong_issuer": lambda: provider.token("bob", ADMIN, iss="http://127.0.0.1:1/evil"),
        # signed by a key the provider never published, under a published kid
        "wrong_key": lambda: provider.token("bob", ADMIN, key=RSAKey.generate_key(2048), kid="rsa-1"),
        "no_kid": lambda: provider.token("bob", ADMIN, header={"alg": "RS256", "typ": "JWT"}),
        "hs256": lambda: provider.token("bob", ADMIN, key=OctKey.import_key(b"k" * 32),
                                        header={"alg": "HS256", "kid": "rsa-1"}),
        "no_username": lambda: provider.token("", ADMIN, sub=""),
    }
    _refused(sso, make[case]())


def test_rotated_key_is_fetched_on_demand(sso: SkredProcess, provider: Provider) -> None:
    provider.rotate("rsa-2")
    token = provider.token("carol", SCOPES_ALL, kid="rsa-2")
    before = provider.jwks_fetches

    def logs_in() -> bool:  # within jwks_min_refresh of the start's fetch the first try may miss
        try:
            amqp(sso, token).close()
            return True
        except pika.exceptions.AMQPConnectionError:
            return False

    wait_until(logs_in, 15, "login with a token signed by the new key")
    assert provider.jwks_fetches > before
    # made-up kids cost at most one fetch per jwks_min_refresh (2 s), however many arrive
    fetches, t0 = provider.jwks_fetches, time.monotonic()
    for i in range(10):
        with pytest.raises(pika.exceptions.AMQPConnectionError):
            amqp(sso, provider.token("mallory", ADMIN, kid=f"made-up-{i}", key=provider.keys["rsa-1"]))
    assert provider.jwks_fetches - fetches <= 1 + (time.monotonic() - t0) / 2


def test_update_secret_swaps_permissions(sso: SkredProcess, provider: Provider) -> None:
    q = unique("us")
    conn = amqp(sso, provider.token("dave", ("skred.configure:%2F/us-*", "skred.read:%2F/us-*")))
    try:
        ch = conn.channel()
        ch.queue_declare(q)
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
            ch.basic_publish("", q, b"x")  # no write scope yet
            ch.queue_declare(q, passive=True)  # a round trip, so the refusal arrives
        assert refused.value.reply_code == 403
        conn.update_secret(provider.token("dave", (*SCOPES_ALL,)), "refresh")
        ch = conn.channel()
        ch.confirm_delivery()
        ch.basic_publish("", q, b"x")
        assert ch.queue_declare(q, passive=True).method.message_count == 1
        # a token of another user is refused, and closes the connection (530)
        with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as closed:
            conn.update_secret(provider.token("eve", SCOPES_ALL), "take over")
        assert closed.value.reply_code == 530
    finally:
        if conn.is_open:
            conn.close()


def test_update_secret_with_a_token_of_a_new_key(sso: SkredProcess, provider: Provider) -> None:
    """The provider rotated its keys while a connection was open: the refreshed token names a kid
    the broker has not fetched; update-secret is answered once the keys are fetched."""
    conn = amqp(sso, provider.token("lena", SCOPES_ALL))
    try:
        provider.rotate("rsa-3")
        # outside the broker's refresh rate limit (jwks_min_refresh = 2 s), an unknown kid fetches
        wait_until(lambda: time.monotonic() - provider.last_fetch > 2.5, 10, "the refresh window to pass")
        fetches = provider.jwks_fetches
        conn.update_secret(provider.token("lena", SCOPES_ALL, kid="rsa-3"), "rotated")
        assert provider.jwks_fetches == fetches + 1
        conn.channel().queue_declare(unique("rot"), auto_delete=True)
    finally:
        if conn.is_open:
            conn.close()


def test_a_token_never_borrows_a_namesakes_tags(sso: SkredProcess, provider: Provider) -> None:
    """An internal user 'ivy' may impersonate (user_id of others); a token whose user name is
    'ivy' has only its own scopes' tags, so its user_id must be its own (406 otherwise)."""
    guest = basic("guest", "guest")
    ivy = {"password": "x", "tags": "impersonator"}
    assert api(sso, "/api/users/ivy", guest, "PUT", ivy)[0] in (201, 204)
    conn = amqp(sso, provider.token("ivy", SCOPES_ALL))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.basic_publish("", unique("none"), b"mine", pika.BasicProperties(user_id="ivy"))
        with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
            ch.basic_publish("", unique("none"), b"other", pika.BasicProperties(user_id="someone-else"))
        assert refused.value.reply_code == 406
    finally:
        if conn.is_open:
            conn.close()
        api(sso, "/api/users/ivy", guest, "DELETE")


def test_expired_token_closes_the_amqp_connection(sso: SkredProcess, provider: Provider) -> None:
    conn = amqp(sso, provider.token("frank", SCOPES_ALL, lifetime=2))
    deadline = time.monotonic() + 15
    with pytest.raises(pika.exceptions.ConnectionClosedByBroker) as closed:
        while time.monotonic() < deadline:
            conn.process_data_events(time_limit=0.5)
    assert closed.value.reply_code == 320
    assert "credential expired" in closed.value.reply_text


# ------------------------------------------------------------------ MQTT
def test_mqtt_token_login_and_expiry(sso: SkredProcess, provider: Provider) -> None:
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=unique("m"), protocol=mqtt.MQTTv5)
    c.username_pw_set("ignored", provider.token("gina", SCOPES_ALL, lifetime=3))
    connected, gone = threading.Event(), threading.Event()
    reasons: list[int] = []
    c.on_connect = lambda _c, _u, _f, rc, _p: (reasons.append(rc.value), connected.set())
    c.on_disconnect = lambda _c, _u, _f, rc, _p: (reasons.append(rc.value), gone.set())
    c.connect(sso.host, sso.mqtt_port, keepalive=60)
    c.loop_start()
    try:
        assert connected.wait(10) and reasons[0] == 0, reasons
        assert gone.wait(15), "still connected after the token expired"
        assert reasons[1] == 0xA0, reasons  # maximum connect time
    finally:
        c.loop_stop()
    bad = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=unique("m"), protocol=mqtt.MQTTv5)
    bad.username_pw_set("ignored", provider.token("gina", SCOPES_ALL, aud="other"))
    refused = threading.Event()
    codes: list[int] = []
    bad.on_connect = lambda _c, _u, _f, rc, _p: (codes.append(rc.value), refused.set())
    bad.connect(sso.host, sso.mqtt_port)
    bad.loop_start()
    try:
        assert refused.wait(10) and codes == [0x86], codes  # bad user name or password
    finally:
        bad.loop_stop()


# ------------------------------------------------------------------ HTTP
def test_management_api_bearer(sso: SkredProcess, provider: Provider) -> None:
    admin = f"Bearer {provider.token('hank', ADMIN)}"
    status, me = api(sso, "/api/whoami", admin)
    assert status == 200 and me["name"] == "hank" and me["tags"] == ["administrator"]
    q = unique("hq")
    assert api(sso, f"/api/queues/%2F/{q}", admin, "PUT", {"durable": True})[0] in (201, 204)
    assert api(sso, f"/api/queues/%2F/{q}", admin)[0] == 200
    # without a management tag the API refuses (as for an internal user without tags)
    status, body = api(sso, "/api/whoami", f"Bearer {provider.token('ivan', SCOPES_ALL)}")
    assert status == 401 and "management" in json.dumps(body)
    # a monitoring token may not create queues
    mon = f"Bearer {provider.token('judy', (*SCOPES_ALL, 'skred.tag:monitoring'))}"
    assert api(sso, "/api/overview", mon)[0] == 200
    assert api(sso, "/api/users", mon)[0] in (401, 403)
    # internal users still log in (the chain: internal, oauth)
    assert api(sso, "/api/whoami", basic("guest", "guest"))[0] == 200
    # the UI's settings name the provider
    status, settings = api(sso, "/api/auth", "")
    assert settings["oauth_enabled"] is True and settings["oauth_client_id"] == provider.client_id


def test_lmq_token_as_password_or_bearer(sso: SkredProcess, provider: Provider) -> None:
    q = unique("lq")
    token = provider.token("kate", (f"skred.configure:%2F/{q}", "skred.write:%2F/amq.default",
                                    f"skred.read:%2F/{q}"))
    status, _ = api(sso, f"/messages/{q}", basic("kate", token), "POST", b"via lmq",
                    port=sso.lmq_http_port)
    assert status in (200, 201, 204), status
    status, _ = api(sso, f"/messages/{q}", f"Bearer {token}", "POST", b"via lmq, bearer",
                    port=sso.lmq_http_port)
    assert status in (200, 201, 204), status
    status, _ = api(sso, f"/messages/{q}-other", basic("kate", token), "POST", b"no",
                    port=sso.lmq_http_port)
    assert status == 403
    assert api(sso, f"/messages/{q}", f"Bearer {token[:-4]}AAAA", "POST", b"no",
               port=sso.lmq_http_port)[0] == 401


def test_lmq_rpc_connection_closes_when_its_token_expires(sso: SkredProcess, provider: Provider) -> None:
    """As AMQP and MQTT: an LMQ MessagePack-RPC connection logged in with a token is closed when
    the token expires (its calls were refused from then on; the connection stayed open)."""
    import asyncio

    import msgpack

    async def main() -> float:
        reader, writer = await asyncio.open_connection(sso.host, sso.lmq_rpc_port)
        try:
            t0 = time.monotonic()
            token = provider.token("hank", SCOPES_ALL, lifetime=2)
            writer.write(msgpack.packb([0, 1, "authenticate", ["hank", token]]))
            unpacker = msgpack.Unpacker(raw=False)
            unpacker.feed(await asyncio.wait_for(reader.read(4096), 10))
            assert next(unpacker) == [1, 1, None, "ok"]
            assert await asyncio.wait_for(reader.read(), 20) == b""  # closed by the broker
            return time.monotonic() - t0
        finally:
            writer.close()

    from ._support import run_async

    assert run_async(main()) < 15


# ------------------------------------------------------------------ the web UI's single sign-on
def test_ui_signs_in_through_the_provider_and_out(sso: SkredProcess, provider: Provider,
                                                  browser: WebDriver) -> None:  # noqa: F811
    """Headless Chromium: the login page's "Sign in with" button, the provider's own login form,
    back to the UI with a token (authorization code + PKCE), the API used with it, and logout
    through the provider's end-session endpoint."""
    provider.logins["uma"] = ("uma-password", [*ADMIN, "openid"])
    driver = browser
    origin = f"http://{sso.host}:{sso.mgmt_port}"
    driver.get(f"{origin}/")
    driver.execute_script("sessionStorage.clear()")
    driver.get("about:blank")
    driver.get(f"{origin}/#/overview")
    assert "Sign in with 127.0.0.1" in element(driver, By.ID, "oauth-login").text
    click(driver, By.ID, "oauth-login")
    element(driver, By.ID, "idp-username").send_keys("uma")
    assert driver.current_url.startswith(provider.issuer)  # the provider's page, not ours
    driver.find_element(By.ID, "idp-password").send_keys("uma-password")
    click(driver, By.ID, "idp-login")
    wait(driver, "signed in", lambda d: d.find_element(By.ID, "who").text.startswith("uma"))
    assert "code=" not in driver.current_url and driver.current_url.startswith(origin)
    assert driver.execute_script("return sessionStorage.getItem('skred.scheme')") == "Bearer"
    # the pages read the API with the token: the overview shows the node
    wait(driver, "overview", lambda d: "Overview" in d.find_element(By.ID, "main").text)
    click(driver, By.ID, "logout")
    element(driver, By.ID, "username")  # back on our login form, through the provider's logout
    assert driver.execute_script("return sessionStorage.getItem('skred.auth')") is None
    # a code cannot be replayed: the provider gave it once (and the UI no longer holds it)
    assert not provider.codes


# ------------------------------------------------------------------ a cluster
def test_tokens_through_a_follower(provider: Provider, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A 3-node cluster with oauth: a follower proxies AMQP and HTTP to the leader, which checks
    the token (the same scopes refuse the same names); the leader fetched the issuer's keys."""
    from .test_cluster import Cluster, start_cluster  # skips without an etcd binary

    c = Cluster(tmp_path_factory.mktemp("oauth-cluster"))
    try:
        for n in c.nodes:
            n.argv += oauth_args(provider)
        leader, followers = start_cluster(c)
        via = followers[0]
        token = provider.token("nina", ("skred.configure:%2F/nq-*", "skred.write:%2F/*", "skred.read:%2F/*",
                                        "skred.tag:management"))
        conn = pika.BlockingConnection(pika.ConnectionParameters(
            via.ip, via.port, "/", pika.PlainCredentials("x", token), connection_attempts=1))
        try:
            ch = conn.channel()
            ch.queue_declare(unique("nq"), durable=True)
            with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
                ch.queue_declare(unique("other"), durable=True)
            assert refused.value.reply_code == 403
        finally:
            conn.close()
        status, me = api(None, "/api/whoami", f"Bearer {token}", host=via.ip, port=via.mgmt_port)
        assert status == 200 and me["name"] == "nina", (status, me)
        assert f"signing key(s) of issuer {provider.issuer}" in leader.log_text()
    finally:
        c.close()
