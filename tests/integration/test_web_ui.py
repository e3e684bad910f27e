"""The web management UI, driven in a real browser (headless Chromium through selenium).

Theory of operation: one broker and one browser serve the whole module. Each test logs in
through the UI's own login form (never with credentials in a URL), acts through the page as a
person would (typing into forms, clicking buttons), and checks what the page shows against what
the JSON API and a real pika client see. Waits poll the page with a deadline (WebDriverWait), never
fixed sleeps. ``SKRED_UI_SCREENSHOTS=DIR`` saves a screenshot of each main page (how docs/ui/ is
made). The tests need Debian's ``chromium`` and ``chromium-driver`` (installed by .ci/run).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import pytest

from ._support import Broker, connect, is_external
from .test_mqtt import Paho

CHROMEDRIVER = shutil.which("chromedriver")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
webdriver = pytest.importorskip("selenium.webdriver")
from selenium.common.exceptions import (  # noqa: E402
    NoSuchElementException,
    StaleElementReferenceException,
    TimeoutException,
)
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

pytestmark = [
    pytest.mark.skipif(
        CHROMEDRIVER is None or CHROMIUM is None,
        reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)",
    ),
    pytest.mark.skipif(is_external(), reason="drives Skred's own UI"),
]
WAIT = 20.0  # seconds; generous, the machine may be loaded
SHOTS = os.environ.get("SKRED_UI_SCREENSHOTS", "")


def api(
    b: Broker,
    method: str,
    path: str,
    body: Any = None,
    user: str = "guest",
    password: str = "guest",
    timeout: float = 10,
) -> Any:
    req = urllib.request.Request(
        f"http://{b.host}:{b.mgmt_port}{path}",
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={
            "Content-Type": "application/json",
            "Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode(),
        },
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        raw = resp.read()
    return json.loads(raw) if raw else None


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    opts = webdriver.ChromeOptions()
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--window-size=1366,900",
        "--disable-gpu",
    ):
        opts.add_argument(arg)
    opts.binary_location = CHROMIUM or ""
    driver = webdriver.Chrome(service=webdriver.ChromeService(executable_path=CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(WAIT)
    try:
        yield driver
    finally:
        driver.quit()


def wait(browser: WebDriver, what: str, pred: Any) -> Any:
    try:
        # Tables are re-rendered by the page's refresh: an element found a moment ago may be gone.
        ignored = (NoSuchElementException, StaleElementReferenceException)
        return WebDriverWait(browser, WAIT, ignored_exceptions=ignored).until(lambda d: pred(d), message=what)
    except TimeoutException:
        # Say what the page showed, so a failure in CI can be read without a screenshot.
        page = browser.execute_script("return document.body ? document.body.innerText : ''")
        raise AssertionError(f"timed out waiting for {what}; the page shows:\n{str(page)[-3000:]}") from None


def element(browser: WebDriver, by: str, value: str) -> Any:
    return wait(browser, f"element {value}", lambda d: d.find_element(by, value))


def click(browser: WebDriver, by: str, value: str) -> None:
    """Find and click, again if a refresh replaced the element in between."""

    def clicked(d: WebDriver) -> bool:
        d.find_element(by, value).click()
        return True

    wait(browser, f"click on {value}", clicked)


def click_until(browser: WebDriver, by: str, value: str, what: str, done: Any) -> None:
    """Click until ``done`` holds. The page's refresh (or the filter box's) re-renders a table:
    a click that lands while the old row is being replaced is lost without an error (seen in CI:
    the link clicked, the queue's page never opened), so the click is made again."""

    def attempt(d: WebDriver) -> bool:
        if done(d):
            return True
        d.find_element(by, value).click()
        return bool(done(d))

    wait(browser, what, attempt)


def text_of(browser: WebDriver, by: str, value: str) -> str:
    try:
        return str(browser.find_element(by, value).text)
    except NoSuchElementException:
        return ""


def login(browser: WebDriver, b: Broker, user: str = "guest", password: str = "guest") -> None:
    browser.get(f"http://{b.host}:{b.mgmt_port}/")
    browser.execute_script("sessionStorage.clear(); localStorage.clear()")  # and the remembered choices
    browser.get("about:blank")  # a fresh page load: a hash change alone would not log out
    # the previous page's refreshes that the cleared credentials turned into 401s are not this
    # test's errors: drop what the browser logged so far
    browser.get_log("browser")
    browser.get(f"http://{b.host}:{b.mgmt_port}/#/overview")
    element(browser, By.ID, "username").send_keys(user)
    browser.find_element(By.ID, "password").send_keys(password)
    click(browser, By.ID, "login-button")
    wait(browser, "logged in", lambda d: d.find_element(By.ID, "who").text.startswith(user))


def go(browser: WebDriver, b: Broker, page: str) -> None:
    browser.get(f"http://{b.host}:{b.mgmt_port}/#/{page}")


def shot(browser: WebDriver, name: str) -> None:
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(Path(SHOTS) / f"{name}.png"))


def fill(browser: WebDriver, form_id: str, **values: str) -> None:
    for name, value in values.items():
        field = browser.find_element(By.ID, f"{form_id}-{name}")
        if field.tag_name == "select":
            Select(field).select_by_visible_text(value)
        else:
            field.clear()
            field.send_keys(value)
    click(browser, By.CSS_SELECTOR, f"#{form_id} button[type=submit]")


def browser_errors(browser: WebDriver) -> list[str]:
    return [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]


# ------------------------------------------------------------------------ tests


def test_login_refuses_wrong_password_and_shows_overview_matching_the_api(
    browser: WebDriver, shared_broker: Broker
) -> None:
    b = shared_broker
    browser.get(f"http://{b.host}:{b.mgmt_port}/")
    browser.execute_script("sessionStorage.clear()")
    browser.refresh()
    element(browser, By.ID, "username").send_keys("guest")
    browser.find_element(By.ID, "password").send_keys("wrong")
    click(browser, By.ID, "login-button")
    wait(browser, "login refused", lambda d: "Login failed" in d.find_element(By.ID, "login-error").text)
    assert "guest" not in browser.current_url and "wrong" not in browser.current_url

    conn = connect(b)
    try:
        ch = conn.channel()
        q = f"ui-overview-{uuid.uuid4().hex[:6]}"
        ch.queue_declare(q)
        for i in range(3):
            ch.basic_publish("", q, f"m{i}".encode())
        login(browser, b)
        overview = api(b, "GET", "/api/overview")
        totals = overview["object_totals"]

        def shows_api_counts(d: WebDriver) -> bool:
            now = api(b, "GET", "/api/overview")
            return (
                d.find_element(By.CSS_SELECTOR, "#total-queues .v").text
                == f"{now['object_totals']['queues']:,}"
                and d.find_element(By.CSS_SELECTOR, "#total-connections .v").text
                == f"{now['object_totals']['connections']:,}"
                and d.find_element(By.CSS_SELECTOR, "#total-ready .v").text
                == f"{now['queue_totals']['messages_ready']:,}"
            )

        wait(browser, "overview counts equal /api/overview", shows_api_counts)
        assert totals["queues"] >= 1
        assert "Nodes" in browser.find_element(By.ID, "main").text
        shot(browser, "overview")
    finally:
        conn.close()
    assert browser_errors(browser) == [] or all("401" in e for e in browser_errors(browser))


def test_queue_declared_over_amqp_appears_and_round_trips_through_the_page(
    browser: WebDriver, shared_broker: Broker
) -> None:
    b = shared_broker
    q = f"ui-q-{uuid.uuid4().hex[:6]}"
    conn = connect(b)
    try:
        conn.channel().queue_declare(q, durable=True)
        login(browser, b)
        go(browser, b, "queues")
        box = element(browser, By.CSS_SELECTOR, "input[aria-label='Filter by name']")
        box.send_keys(q)
        wait(browser, "queue listed", lambda d: q in d.find_element(By.ID, "main").text)
        shot(browser, "queues")
        click_until(browser, By.LINK_TEXT, q, "queue page",
                    lambda d: text_of(d, By.TAG_NAME, "h1") == f"Queue {q}")

        # Publish from the page, with a header, then get it back on the page (requeued) ...
        fill(browser, "publish", headers='{"x-ui": "yes"}', payload="hello from the browser")
        wait(browser, "ready count 1", lambda d: text_of(d, By.ID, "queue-ready") == "1")
        fill(browser, "get", ackmode="ack_requeue_true")
        got = wait(
            browser, "message shown", lambda d: d.find_element(By.CSS_SELECTOR, "#got-messages pre.payload")
        )
        assert got.text == "hello from the browser"
        assert "x-ui" in browser.find_element(By.ID, "got-messages").text
        shot(browser, "queue")

        # ... and from a pika consumer, with the properties the form set.
        ch = conn.channel()
        method, props, body = ch.basic_get(q, auto_ack=True)
        assert body == b"hello from the browser"
        assert props.headers == {"x-ui": "yes"} and props.delivery_mode == 2
        assert method.redelivered  # the page's get requeued it
    finally:
        conn.close()


def test_bindings_purge_and_delete_from_the_pages(browser: WebDriver, shared_broker: Broker) -> None:
    b = shared_broker
    q = f"ui-bind-{uuid.uuid4().hex[:6]}"
    x = f"ui-x-{uuid.uuid4().hex[:6]}"
    conn = connect(b)
    try:
        ch = conn.channel()
        ch.queue_declare(q)
        ch.exchange_declare(x, "topic")
        login(browser, b)
        go(browser, b, f"queues/%2F/{q}")
        wait(browser, "queue page", lambda d: d.find_element(By.TAG_NAME, "h1").text == f"Queue {q}")
        fill(browser, "bind", source=x, routing_key="a.#")
        wait(browser, "binding listed", lambda d: "a.#" in d.find_element(By.ID, "main").text)
        bindings = api(b, "GET", f"/api/queues/%2F/{q}/bindings")
        assert any(bd["source"] == x and bd["routing_key"] == "a.#" for bd in bindings)

        # The exchange page shows the binding and publishes through it.
        go(browser, b, f"exchanges/%2F/{x}")
        wait(browser, "exchange page", lambda d: "a.#" in d.find_element(By.ID, "main").text)
        shot(browser, "exchange")
        fill(browser, "publish", routing_key="a.b", payload="via exchange")
        wait(browser, "routed", lambda d: api(b, "GET", f"/api/queues/%2F/{q}")["messages_ready"] == 1)

        go(browser, b, f"queues/%2F/{q}")
        wait(browser, "queue page", lambda d: text_of(d, By.ID, "queue-ready") == "1")
        click(browser, By.XPATH, "//button[text()='Unbind' and ancestor::tr[contains(., 'a.#')]]")
        wait(
            browser,
            "unbound",
            lambda d: not any(bd["source"] == x for bd in api(b, "GET", f"/api/queues/%2F/{q}/bindings")),
        )
        browser.execute_script("window.confirm = () => true")
        click(browser, By.XPATH, "//button[text()='Purge']")
        wait(browser, "purged", lambda d: api(b, "GET", f"/api/queues/%2F/{q}")["messages_ready"] == 0)
        click(browser, By.XPATH, "//button[text()='Delete queue']")
        wait(browser, "back on the list", lambda d: d.current_url.endswith("#/queues"))

        def gone() -> bool:
            try:
                api(b, "GET", f"/api/queues/%2F/{q}")
            except urllib.error.HTTPError as exc:
                return exc.code == 404
            return False

        wait(browser, "queue deleted", lambda d: gone())
    finally:
        conn.close()


def test_lists_page_through_many_queues(browser: WebDriver, shared_broker: Broker) -> None:
    b = shared_broker
    prefix = f"ui-many-{uuid.uuid4().hex[:4]}-"
    conn = connect(b)
    try:
        ch = conn.channel()
        for i in range(120):
            ch.queue_declare(f"{prefix}{i:03d}")
        login(browser, b)
        go(browser, b, "queues")
        box = element(browser, By.CSS_SELECTOR, "input[aria-label='Filter by name']")
        box.send_keys("^" + prefix)
        # The filter is typed a key at a time; wait for the answer to the whole of it.
        wait(
            browser,
            "first page",
            lambda d: "Page 1 of 3 · 120 matching" in d.find_element(By.ID, "main").text,
        )
        rows = browser.find_elements(By.CSS_SELECTOR, "#main tbody tr")
        assert len(rows) == 50  # one page, not the whole list
        click(browser, By.XPATH, "//button[contains(., 'Next')]")
        wait(browser, "second page", lambda d: "Page 2 of 3" in d.find_element(By.ID, "main").text)
        assert f"{prefix}050" in browser.find_element(By.ID, "main").text
        # Sorting by a column re-asks the API from page 1: the list is sorted by name, so one
        # click on Name reverses it and the last queue comes first.
        click(browser, By.XPATH, "//th/button[starts-with(., 'Name')]")
        wait(
            browser,
            "sorted descending",
            lambda d: d.find_elements(By.CSS_SELECTOR, "#main tbody tr")[0].text.startswith(f"{prefix}119"),
        )
    finally:
        for i in range(120):
            conn.channel().queue_delete(f"{prefix}{i:03d}")
        conn.close()


def test_admin_adds_a_monitoring_user_who_can_look_but_not_change(
    browser: WebDriver, shared_broker: Broker
) -> None:
    b = shared_broker
    user = f"watcher{uuid.uuid4().hex[:4]}"
    q = f"ui-watch-{uuid.uuid4().hex[:6]}"
    conn = connect(b)
    try:
        conn.channel().queue_declare(q)
        login(browser, b)
        go(browser, b, "admin/users")
        fill(browser, "add-user", name=user, password="s3cret-pass", tags="monitoring")
        wait(browser, "user listed", lambda d: user in d.find_element(By.ID, "main").text)
        shot(browser, "admin-users")
        go(browser, b, "admin/permissions")
        fill(browser, "set-permission", user=user, vhost="/", configure="", write="", read=".*")
        wait(browser, "permission listed", lambda d: user in d.find_element(By.ID, "main").text)
        click(browser, By.ID, "logout")
        wait(browser, "logged out", lambda d: d.find_element(By.ID, "login-button"))

        login(browser, b, user, "s3cret-pass")
        assert not browser.find_element(By.CSS_SELECTOR, "a[data-admin]").is_displayed()
        go(browser, b, f"queues/%2F/{q}")
        wait(browser, "queue visible", lambda d: d.find_element(By.TAG_NAME, "h1").text == f"Queue {q}")
        browser.execute_script("window.confirm = () => true")
        click(browser, By.XPATH, "//button[text()='Delete queue']")
        wait(browser, "refusal shown", lambda d: "Refused" in d.find_element(By.ID, "toast").text)
        assert api(b, "GET", f"/api/queues/%2F/{q}")["name"] == q  # still there
        go(browser, b, "admin/users")
        wait(
            browser,
            "users list refused",
            lambda d: (
                "Not administrator" in d.find_element(By.ID, "main").text
                or "not" in d.find_element(By.ID, "main").text.lower()
            ),
        )
    finally:
        conn.close()
        try:
            api(b, "DELETE", f"/api/users/{user}")
        except urllib.error.HTTPError:
            pass


def test_definitions_import_from_a_file_shows_its_queues(
    browser: WebDriver, shared_broker: Broker, tmp_path: Path
) -> None:
    b = shared_broker
    q = f"ui-imported-{uuid.uuid4().hex[:6]}"
    doc = {"queues": [{"name": q, "vhost": "/", "durable": True, "auto_delete": False, "arguments": {}}]}
    path = tmp_path / "defs.json"
    path.write_text(json.dumps(doc))
    login(browser, b)
    go(browser, b, "admin/definitions")
    element(browser, By.ID, "import-file").send_keys(str(path))
    click(browser, By.ID, "import")
    wait(
        browser, "imported", lambda d: d.find_element(By.ID, "import-result").text == "Definitions imported."
    )
    shot(browser, "admin-definitions")
    go(browser, b, "queues")
    element(browser, By.CSS_SELECTOR, "input[aria-label='Filter by name']").send_keys(q)
    wait(browser, "imported queue listed", lambda d: q in d.find_element(By.ID, "main").text)
    conn = connect(b)
    try:
        conn.channel().queue_declare(q, passive=True, durable=True)
    finally:
        conn.close()


def test_connection_page_closes_the_connection(browser: WebDriver, shared_broker: Broker) -> None:
    b = shared_broker
    params = pika.ConnectionParameters(b.host, b.port, client_properties={"connection_name": "ui-victim"})
    conn = pika.BlockingConnection(params)
    device = Paho(b.host, b.mqtt_port, "ui-device")  # an MQTT connection is listed beside it
    try:
        names = [c["name"] for c in api(b, "GET", "/api/connections")]
        login(browser, b)
        go(browser, b, "connections")
        wait(
            browser,
            "connections listed",
            lambda d: all(n in d.find_element(By.ID, "main").text for n in names)
            and "MQTT 3.1.1" in d.find_element(By.ID, "main").text
            and "ui-device" in d.find_element(By.ID, "main").text,
        )
        shot(browser, "connections")
        mine = [
            c
            for c in api(b, "GET", "/api/connections")
            if c["client_properties"].get("connection_name") == "ui-victim"
        ]
        assert mine
        go(browser, b, "connections/" + urllib.request.quote(mine[0]["name"], safe=""))
        wait(browser, "connection page", lambda d: "Close connection" in d.find_element(By.ID, "main").text)
        browser.execute_script("window.confirm = () => true")
        click(browser, By.XPATH, "//button[text()='Close connection']")
        wait(
            browser,
            "closed",
            lambda d: not any(c["name"] == mine[0]["name"] for c in api(b, "GET", "/api/connections")),
        )
        with pytest.raises(pika.exceptions.AMQPError):
            conn.process_data_events(time_limit=5)
            conn.channel()
    finally:
        device.close()
        if conn.is_open:
            conn.close()


def test_static_files_are_safe(shared_broker: Broker) -> None:
    b = shared_broker
    with urllib.request.urlopen(f"http://{b.host}:{b.mgmt_port}/", timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/html")
        assert "default-src 'self'" in resp.headers["Content-Security-Policy"]
        assert b"/ui/app.js" in resp.read()
    for bad in ("/ui/..%2Fserver.py", "/ui/ui.py", "/ui/.hidden.js", "/ui/nope.js"):
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(f"http://{b.host}:{b.mgmt_port}{bad}", timeout=10)
        assert info.value.code == 404
    # The UI's own requests get no WWW-Authenticate (no browser login pop-up); other clients do.
    req = urllib.request.Request(
        f"http://{b.host}:{b.mgmt_port}/api/whoami", headers={"X-Requested-With": "XMLHttpRequest"}
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=10)
    assert info.value.code == 401 and "WWW-Authenticate" not in info.value.headers
    assert info.value.headers["X-Skred-Challenge"].startswith("Basic")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"http://{b.host}:{b.mgmt_port}/api/whoami", timeout=10)
    assert info.value.code == 401 and "WWW-Authenticate" in info.value.headers


def test_overview_names_the_cluster_leader(browser: WebDriver, tmp_path: Path) -> None:
    from .test_cluster import Cluster, start_cluster, wait_for

    cluster = Cluster(tmp_path)
    try:
        leader, followers = start_cluster(cluster)
        leader_id = wait_for(
            lambda: (leader.data_dir / ".node_id").exists() and leader.node_id(), 20, "node id"
        )

        class Node:  # what login() and go() need of a broker
            host, mgmt_port = leader.ip, leader.mgmt_port

        node = Node()
        login(browser, node)  # type: ignore[arg-type]
        wait(browser, "leader shown", lambda d: text_of(d, By.ID, "cluster-leader") == leader_id)
        wait(
            browser,
            "followers listed",
            lambda d: all(f.node_id() in d.find_element(By.ID, "main").text for f in followers),
        )
        shot(browser, "overview-cluster")
    finally:
        cluster.close()


def test_stream_queue_is_browsed_from_an_offset(browser: WebDriver, shared_broker: Broker) -> None:
    b = shared_broker
    q = f"ui-stream-{uuid.uuid4().hex[:6]}"
    conn = connect(b)
    try:
        ch = conn.channel()
        ch.queue_declare(q, durable=True, arguments={"x-queue-type": "stream"})
        ch.confirm_delivery()
        for i in range(5):
            ch.basic_publish("", q, f"event-{i}".encode())
        login(browser, b)
        go(browser, b, f"queues/%2F/{q}")
        element(browser, By.ID, "browse")
        fill(browser, "browse", value="2", count="2")
        wait(
            browser,
            "two events from offset 2",
            lambda d: (
                "event-2" in d.find_element(By.ID, "main").text
                and "event-3" in d.find_element(By.ID, "main").text
            ),
        )
        assert "event-1" not in browser.find_element(By.ID, "main").text
        assert "event-4" not in browser.find_element(By.ID, "main").text
    finally:
        conn.channel().queue_delete(q)
        conn.close()


def test_management_user_sees_only_its_vhosts(browser: WebDriver, shared_broker: Broker) -> None:
    b = shared_broker
    user, vhost = f"mgr{uuid.uuid4().hex[:4]}", f"ui-vh-{uuid.uuid4().hex[:4]}"
    hidden = f"ui-hidden-{uuid.uuid4().hex[:6]}"
    api(b, "PUT", f"/api/vhosts/{vhost}", {})
    api(b, "PUT", f"/api/users/{user}", {"password": "pw-123456", "tags": "management"})
    api(b, "PUT", f"/api/permissions/{vhost}/{user}", {"configure": ".*", "write": ".*", "read": ".*"})
    api(b, "PUT", f"/api/queues/{vhost}/mine", {"durable": True})
    api(b, "PUT", f"/api/queues/%2F/{hidden}", {"durable": False})
    try:
        login(browser, b, user, "pw-123456")
        go(browser, b, "queues")
        wait(browser, "own queue listed", lambda d: "mine" in d.find_element(By.ID, "main").text)
        assert hidden not in browser.find_element(By.ID, "main").text
        assert not browser.find_element(By.CSS_SELECTOR, "a[data-admin]").is_displayed()
    finally:
        api(b, "DELETE", f"/api/queues/%2F/{hidden}")
        api(b, "DELETE", f"/api/vhosts/{vhost}")
        api(b, "DELETE", f"/api/users/{user}")


def test_federation_tab_adds_an_upstream_and_shows_its_link(browser: WebDriver,
                                                            shared_broker: Broker) -> None:
    """Admin > Federation: an upstream added through the form is stored, refused input is shown,
    and a policy's link appears with its status and reason (nothing listens on the port)."""
    b = shared_broker
    name = f"ui-up-{uuid.uuid4().hex[:6]}"
    login(browser, b)
    go(browser, b, "admin/federation")
    element(browser, By.ID, "add-upstream-name").send_keys(name)
    browser.find_element(By.ID, "add-upstream-uri").send_keys("ftp://nowhere")
    click(browser, By.CSS_SELECTOR, "#add-upstream button[type=submit]")
    wait(browser, "refusal shown",
         lambda d: "scheme" in d.find_element(By.CSS_SELECTOR, "#add-upstream .error").text)
    uri = browser.find_element(By.ID, "add-upstream-uri")
    uri.clear()
    uri.send_keys("amqp://127.0.0.1:1/")
    browser.find_element(By.ID, "add-upstream-settings").send_keys('{"reconnect-delay": 1}')
    click(browser, By.CSS_SELECTOR, "#add-upstream button[type=submit]")
    wait(browser, "upstream listed", lambda d: name in d.find_element(By.ID, "main").text)
    assert api(b, "GET", f"/api/parameters/federation-upstream/%2F/{name}")["value"] == {
        "uri": "amqp://127.0.0.1:1/", "reconnect-delay": 1}
    pol = f"ui-fed-{uuid.uuid4().hex[:6]}"
    api(b, "PUT", f"/api/policies/%2F/{pol}", {"pattern": "^ui-fed-x$", "apply-to": "exchanges",
                                              "definition": {"federation-upstream": name}})
    conn = connect(b)
    try:
        conn.channel().exchange_declare("ui-fed-x", "fanout")
        wait(browser, "link listed with its error",
             lambda d: "cannot connect" in d.find_element(By.ID, "main").text)
        shot(browser, "admin-federation")
    finally:
        api(b, "DELETE", f"/api/policies/%2F/{pol}")
        api(b, "DELETE", f"/api/parameters/federation-upstream/%2F/{name}")
        conn.channel().exchange_delete("ui-fed-x")


def test_shovels_page_adds_pauses_and_deletes_a_shovel(browser: WebDriver, shared_broker: Broker) -> None:
    b = shared_broker
    src, dst, name = (f"ui-shovel-{k}-{uuid.uuid4().hex[:6]}" for k in ("src", "dst", "name"))
    conn = connect(b)
    try:
        ch = conn.channel()
        ch.queue_declare(src, durable=True)
        ch.basic_publish("", src, b"to be moved", pika.BasicProperties(delivery_mode=2))
        login(browser, b)
        go(browser, b, "shovels")
        fill(browser, "add-shovel", name=name, **{"src-queue": src, "dest-queue": dst})
        wait(browser, "shovel running", lambda d: "running" in d.find_element(By.ID, "main").text
             and name in d.find_element(By.ID, "main").text)
        shot(browser, "shovels")
        wait(browser, "moved", lambda _: ch.queue_declare(dst, passive=True).method.message_count == 1)

        def states() -> list[str]:
            return [s["state"] for s in api(b, "GET", "/api/shovels") if s["name"] == name]
        click(browser, By.XPATH, f"//tr[td[text()='{name}']]//button[text()='Pause']")
        wait(browser, "shovel paused", lambda _: states() == ["paused"])
        browser.execute_script("window.confirm = () => true")
        click(browser, By.XPATH, f"//tr[td[text()='{name}']]//button[text()='Delete']")
        wait(browser, "shovel gone", lambda _: states() == [])
        assert not browser_errors(browser)
    finally:
        conn.close()


def test_queue_page_pauses_and_resumes_the_queue(browser: WebDriver, shared_broker: Broker) -> None:
    b = shared_broker
    q = f"ui-pause-{uuid.uuid4().hex[:6]}"
    conn = connect(b)
    try:
        conn.channel().queue_declare(q, durable=True)
        login(browser, b)
        go(browser, b, f"queues/%2F/{q}")
        wait(browser, "queue running", lambda d: text_of(d, By.ID, "queue-state") == "running")
        click(browser, By.ID, "queue-pause")
        wait(browser, "queue paused", lambda d: text_of(d, By.ID, "queue-state") == "paused")
        shot(browser, "queue-paused")
        click(browser, By.ID, "queue-resume")
        wait(browser, "queue running again", lambda d: text_of(d, By.ID, "queue-state") == "running")
        # restart (LavinMQ's): the store is reopened, the queue answers running with its messages
        conn.channel().basic_publish("", q, b"kept")
        click(browser, By.ID, "queue-restart")
        wait(browser, "the restart acknowledged",
             lambda d: "Queue restarted." in d.find_element(By.ID, "toast").text)
        wait(browser, "running after the restart", lambda d: text_of(d, By.ID, "queue-state") == "running")
    finally:
        conn.channel().queue_delete(q)
        conn.close()
