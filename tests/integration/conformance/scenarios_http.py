"""HTTP management API scenarios: the endpoints rabbitmqadmin, dashboards and health probes use.

Each call is recorded as ``("http", method, path, status, keys)``: the status exactly, and the
JSON body's key set (for a list, the union of its items' keys; nested objects as ``a.b``). The
harness compares key sets one way: every key RabbitMQ sends must be in Skred's answer (a tool
reads what RabbitMQ sends) unless ``allowlist.HTTP_KEYS`` names it; keys only Skred has are not a
difference, and neither are the item keys of an empty list. Values are not compared
(rates, timestamps, node names and versions legitimately differ) except where a scenario notes
one on purpose.
"""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

from pamqp import commands as C

from ._wire import Run

Scenario = Callable[[Run], None]
SCENARIOS: dict[str, Scenario] = {}
GUEST = ("guest", "guest")


def scenario(fn: Scenario) -> Scenario:
    SCENARIOS[fn.__name__] = fn
    return fn


def q(s: str) -> str:
    return urllib.parse.quote(s, safe="")


def keys_of(body: Any) -> list[str] | None:
    if isinstance(body, dict):
        out = set()
        for k, v in body.items():
            out.add(k)
            if isinstance(v, dict) and k not in ("arguments", "definition", "value", "headers",
                                                   "properties", "client_properties",
                                                   "capabilities", "limits", "cluster_state"):
                out.update(f"{k}.{kk}" for kk in v)
        return sorted(out)
    if isinstance(body, list):
        if not body:
            return None  # an empty list has no item keys to compare
        merged: set[str] = set()
        for item in body:
            merged.update(keys_of(item) or [])
        return sorted(merged)
    return None


def call(r: Run, method: str, path: str, body: Any = None, auth: tuple[str, str] | None = GUEST,
         raw: bytes | None = None, keys: bool = True, record: bool = True,
         values: bool = False) -> tuple[int, Any]:
    """One request, recorded unless ``record`` is False; returns (status, parsed JSON or text).
    With ``values`` the whole body is recorded (normalised) and compared, not only its keys."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(f"http://{r.host}:{r.mgmt_port}{path}", data=data, method=method)
    if auth:
        req.add_header("Authorization", "Basic " + base64.b64encode(":".join(auth).encode()).decode())
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=15) as resp:
            status, text = int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        status, text = int(exc.code), exc.read()
    try:
        parsed: Any = json.loads(text) if text.strip() else None
    except ValueError:
        parsed = text.decode(errors="replace")
    if not record:
        return status, parsed
    shown = path
    for logical, real in r.names.items():
        shown = shown.replace(q(real), f"<{logical}>")
    for node in r.node_names:  # before the port: a node name may contain it
        shown = shown.replace(q(node), "<node>")
    shown = shown.replace(str(r.port), "<amqp-port>")
    if values:
        r.note("http", method, shown, status, "body", parsed)
    else:
        r.note("http", method, shown, status, keys_of(parsed) if keys else None)
    return status, parsed


def node_name(r: Run) -> str:
    _, nodes = call(r, "GET", "/api/nodes", keys=False)
    name = str(nodes[0]["name"])
    r.node_names.append(name)
    return name


# -- read-only listings --------------------------------------------------------------------------
@scenario
def listings(r: Run) -> None:
    for path in ("/api/overview", "/api/vhosts", "/api/vhosts/%2F", "/api/users", "/api/users/guest",
                 "/api/whoami", "/api/permissions", "/api/permissions/%2F/guest",
                 "/api/exchanges/%2F/amq.direct", "/api/exchanges/%2F/amq.direct/bindings/source",
                 "/api/policies", "/api/policies/%2F", "/api/operator-policies",
                 "/api/vhost-limits", "/api/parameters", "/api/global-parameters",
                 "/api/extensions", "/api/cluster-name", "/api/auth", "/api/users/without-permissions",
                 "/api/topic-permissions", "/api/feature-flags", "/api/definitions",
                 "/api/definitions/%2F"):
        call(r, "GET", path)


@scenario
def nodes(r: Run) -> None:
    node = node_name(r)
    call(r, "GET", "/api/nodes")
    call(r, "GET", f"/api/nodes/{q(node)}")


@scenario
def exchanges_and_queues(r: Run) -> None:
    vh = q("/")
    qn = r.name("q")
    call(r, "PUT", f"/api/queues/{vh}/{q(qn)}", {"durable": False, "auto_delete": True,
                                                  "arguments": {"x-max-length": 10}})
    call(r, "PUT", f"/api/queues/{vh}/{q(qn)}", {"durable": False, "auto_delete": True,
                                                  "arguments": {"x-max-length": 10}})
    call(r, "PUT", f"/api/queues/{vh}/{q(qn)}", {"durable": True})  # inequivalent
    call(r, "PUT", f"/api/bindings/{vh}/e/amq.direct/q/{q(qn)}", {"routing_key": qn})  # 405: POST
    call(r, "POST", f"/api/bindings/{vh}/e/amq.direct/q/{q(qn)}", {"routing_key": qn})
    call(r, "POST", f"/api/exchanges/{vh}/amq.direct/publish",
         {"routing_key": qn, "payload": "hello", "payload_encoding": "string",
          "properties": {"content_type": "text/plain", "headers": {"h": 1}, "delivery_mode": 2}},
         values=True)
    call(r, "POST", f"/api/exchanges/{vh}/amq.direct/publish",
         {"routing_key": "nowhere", "payload": "x", "payload_encoding": "string", "properties": {}},
         values=True)
    call(r, "POST", f"/api/exchanges/{vh}/amq.default/publish",
         {"routing_key": qn, "payload": "aGk=", "payload_encoding": "base64", "properties": {}},
         values=True)
    call(r, "POST", f"/api/exchanges/{vh}/amq.default/publish",
         {"routing_key": qn, "payload": "\u00ff\u0000", "payload_encoding": "string",
          "properties": {}}, values=True)
    call(r, "POST", f"/api/queues/{vh}/{q(qn)}/get",
         {"count": 5, "ackmode": "ack_requeue_true", "encoding": "auto"}, values=True)
    call(r, "POST", f"/api/queues/{vh}/{q(qn)}/get",
         {"count": 1, "ackmode": "reject_requeue_true", "encoding": "base64", "truncate": 2},
         values=True)
    # an unknown ackmode: Skred 400, RabbitMQ 3.10 crashes with 500 (its bug), so not compared
    call(r, "GET", f"/api/queues/{vh}/{q(qn)}")
    call(r, "GET", f"/api/queues/{vh}")
    call(r, "GET", f"/api/exchanges/{vh}")
    call(r, "DELETE", f"/api/queues/{vh}/{q(qn)}/contents")
    call(r, "DELETE", f"/api/queues/{vh}/{q(qn)}?if-empty=true")
    call(r, "DELETE", f"/api/queues/{vh}/{q(qn)}")
    call(r, "GET", f"/api/queues/{vh}/{q(qn)}")


@scenario
def exchange_lifecycle(r: Run) -> None:
    vh = q("/")
    xn, qn = r.name("x"), r.name("q")
    call(r, "PUT", f"/api/exchanges/{vh}/{q(xn)}", {"type": "topic", "durable": False})
    call(r, "PUT", f"/api/exchanges/{vh}/{q(xn)}", {"type": "fanout", "durable": False})
    call(r, "PUT", f"/api/exchanges/{vh}/{q(r.name('bad'))}", {"type": "no-such-type"})
    call(r, "PUT", f"/api/exchanges/{vh}/amq.{r.tag}", {"type": "direct"})
    call(r, "PUT", f"/api/queues/{vh}/{q(qn)}", {"durable": False})
    status, _ = call(r, "POST", f"/api/bindings/{vh}/e/{q(xn)}/q/{q(qn)}",
                     {"routing_key": "a.#", "arguments": {}})
    call(r, "GET", f"/api/bindings/{vh}/e/{q(xn)}/q/{q(qn)}")
    call(r, "GET", f"/api/bindings/{vh}/e/{q(xn)}/q/{q(qn)}/a.%23")
    call(r, "GET", f"/api/exchanges/{vh}/{q(xn)}/bindings/source")
    call(r, "GET", f"/api/queues/{vh}/{q(qn)}/bindings")
    call(r, "POST", f"/api/bindings/{vh}/e/{q(r.name('missing'))}/q/{q(qn)}", {"routing_key": "k"})
    call(r, "DELETE", f"/api/bindings/{vh}/e/{q(xn)}/q/{q(qn)}/a.%23")
    call(r, "DELETE", f"/api/bindings/{vh}/e/{q(xn)}/q/{q(qn)}/a.%23")
    call(r, "DELETE", f"/api/exchanges/{vh}/{q(xn)}?if-unused=true")
    call(r, "DELETE", f"/api/exchanges/{vh}/{q(xn)}")
    call(r, "DELETE", f"/api/exchanges/{vh}/{q(xn)}")
    call(r, "DELETE", f"/api/queues/{vh}/{q(qn)}")


@scenario
def vhosts_users_permissions(r: Run) -> None:
    vh, user = r.name("vh"), r.name("user")
    call(r, "PUT", f"/api/vhosts/{q(vh)}", {"description": "d", "tags": "a,b"})
    call(r, "PUT", f"/api/vhosts/{q(vh)}", {})
    call(r, "GET", f"/api/vhosts/{q(vh)}")
    call(r, "GET", f"/api/vhosts/{q(vh)}/permissions")
    call(r, "PUT", f"/api/users/{q(user)}", {"password": "pw", "tags": "management"})
    call(r, "PUT", f"/api/users/{q(user)}", {"password": "pw2", "tags": ""})
    call(r, "PUT", f"/api/users/{q(user)}", {"tags": "x"})  # neither password nor hash
    call(r, "PUT", f"/api/permissions/{q(vh)}/{q(user)}", {"configure": ".*", "write": ".*", "read": ""})
    call(r, "GET", f"/api/permissions/{q(vh)}/{q(user)}")
    call(r, "GET", f"/api/users/{q(user)}/permissions")
    call(r, "PUT", f"/api/permissions/{q(vh)}/{q(r.name('nobody'))}", {"configure": ".*", "write": ".*",
                                                                       "read": ".*"})
    call(r, "GET", "/api/whoami", auth=(user, "pw2"))
    call(r, "GET", "/api/overview", auth=(user, "pw2"))
    call(r, "GET", "/api/users", auth=(user, "pw2"))
    call(r, "DELETE", f"/api/permissions/{q(vh)}/{q(user)}")
    call(r, "DELETE", f"/api/permissions/{q(vh)}/{q(user)}")
    call(r, "PUT", f"/api/vhost-limits/{q(vh)}/max-queues", {"value": 10})
    call(r, "GET", f"/api/vhost-limits/{q(vh)}")
    call(r, "DELETE", f"/api/vhost-limits/{q(vh)}/max-queues")
    call(r, "DELETE", f"/api/users/{q(user)}")
    call(r, "DELETE", f"/api/users/{q(user)}")
    call(r, "DELETE", f"/api/vhosts/{q(vh)}")
    call(r, "DELETE", f"/api/vhosts/{q(vh)}")
    call(r, "GET", f"/api/vhosts/{q(vh)}")


@scenario
def bulk_delete_users(r: Run) -> None:
    names = [r.name("u1"), r.name("u2")]
    for n in names:
        call(r, "PUT", f"/api/users/{q(n)}", {"password": "pw", "tags": ""})
    call(r, "POST", "/api/users/bulk-delete", {"users": [*names, r.name("never")]})
    for n in names:
        call(r, "GET", f"/api/users/{q(n)}")
    call(r, "POST", "/api/users/bulk-delete", {"nope": []})


@scenario
def policies(r: Run) -> None:
    vh = q("/")
    pn = r.name("p")
    call(r, "PUT", f"/api/policies/{vh}/{q(pn)}",
         {"pattern": f"^{r.tag}$", "definition": {"max-length": 5}, "priority": 1, "apply-to": "queues"})
    call(r, "GET", f"/api/policies/{vh}/{q(pn)}")
    call(r, "PUT", f"/api/queues/{vh}/{q(r.tag)}", {"durable": False})
    call(r, "PUT", f"/api/operator-policies/{vh}/{q(pn)}",
         {"pattern": f"^{r.tag}$", "definition": {"max-length": 3, "message-ttl": 1000},
          "apply-to": "queues"})
    status, detail = call(r, "GET", f"/api/queues/{vh}/{q(r.tag)}")
    for _ in range(100):  # RabbitMQ applies policies to a queue asynchronously
        if isinstance(detail, dict) and detail.get("operator_policy"):
            break
        time.sleep(0.05)  # poll interval, bounded by the loop count
        status, detail = call(r, "GET", f"/api/queues/{vh}/{q(r.tag)}", record=False)
    r.note("effective", detail.get("policy"), detail.get("operator_policy"),
           detail.get("effective_policy_definition"))
    call(r, "DELETE", f"/api/operator-policies/{vh}/{q(pn)}")
    call(r, "DELETE", f"/api/queues/{vh}/{q(r.tag)}")
    call(r, "PUT", f"/api/policies/{vh}/{q(pn)}",
         {"pattern": "x", "definition": {"no-such-key": 5}, "apply-to": "queues"})
    call(r, "PUT", f"/api/policies/{vh}/{q(pn)}", {"pattern": "x"})
    call(r, "DELETE", f"/api/policies/{vh}/{q(pn)}")
    call(r, "DELETE", f"/api/policies/{vh}/{q(pn)}")
    call(r, "PUT", f"/api/operator-policies/{vh}/{q(pn)}",
         {"pattern": f"^{r.tag}$", "definition": {"max-length": 5}, "apply-to": "queues"})
    call(r, "GET", f"/api/operator-policies/{vh}/{q(pn)}")
    call(r, "DELETE", f"/api/operator-policies/{vh}/{q(pn)}")


@scenario
def health_checks(r: Run) -> None:
    for path in ("/api/health/checks/alarms", "/api/health/checks/local-alarms",
                 "/api/health/checks/certificate-expiration/1/months",
                 f"/api/health/checks/port-listener/{r.port}",
                 "/api/health/checks/port-listener/1",
                 "/api/health/checks/protocol-listener/amqp",
                 "/api/health/checks/protocol-listener/stomp",
                 "/api/health/checks/virtual-hosts",
                 "/api/health/checks/node-is-mirror-sync-critical",
                 "/api/health/checks/node-is-quorum-critical",
                 "/api/aliveness-test/%2F", "/api/aliveness-test/no-such-vhost"):
        call(r, "GET", path)


@scenario
def auth_errors(r: Run) -> None:
    call(r, "GET", "/api/overview", auth=None)
    call(r, "GET", "/api/overview", auth=("guest", "wrong"))
    call(r, "GET", "/api/queues", auth=("nobody-" + r.tag, "x"))
    call(r, "PUT", f"/api/vhosts/{q(r.name('vh'))}", raw=b"{not json")
    call(r, "GET", "/api/no-such-endpoint")
    call(r, "GET", "/api/queues/no-such-vhost")
    call(r, "GET", "/api/exchanges/%2F/" + q(r.name("missing")))


@scenario
def pagination_and_sorting(r: Run) -> None:
    vh = q("/")
    names = [r.name(f"p{i}") for i in range(3)]
    for n in names:
        call(r, "PUT", f"/api/queues/{vh}/{q(n)}", {"durable": False, "auto_delete": False})
    flt = q(f"^conf.p[0-9].{r.tag}$")
    status, page = call(r, "GET", f"/api/queues/{vh}?page=1&page_size=2&name={flt}&use_regex=true"
                        "&sort=name&sort_reverse=true")
    if isinstance(page, dict):
        r.note("page", page.get("filtered_count"), page.get("item_count"), page.get("page_count"),
               [x.get("name") for x in page.get("items", [])])
    status, page = call(r, "GET", f"/api/queues?page=2&page_size=2&name={flt}&use_regex=true"
                        "&sort=name")
    if isinstance(page, dict):
        r.note("page 2", [x.get("name") for x in page.get("items", [])])
    call(r, "GET", "/api/queues?page=0&page_size=2")
    call(r, "GET", "/api/queues?page=1&page_size=1000")
    call(r, "GET", f"/api/queues/{vh}?columns=name,messages&name={flt}&use_regex=true")
    for n in names:
        call(r, "DELETE", f"/api/queues/{vh}/{q(n)}")


@scenario
def connections_channels_consumers(r: Run) -> None:
    """A live AMQP connection as the API lists it, and closed through the API."""
    c = r.conn()
    qn = r.name("q")
    c.call(1, C.Queue.Declare(queue=qn, exclusive=True))
    c.call(1, C.Basic.Consume(queue=qn, consumer_tag="t"))
    name = ""
    for _ in range(200):  # the API lists a connection after its first stats emission
        _, conns = call(r, "GET", "/api/connections", keys=False, record=False)
        mine = [x for x in conns or [] if x.get("peer_port") == c.raw.sock.getsockname()[1]]
        _, consumers = call(r, "GET", "/api/consumers", keys=False, record=False)
        if mine and any(x.get("consumer_tag") == "t" for x in consumers or []):
            name = str(mine[0]["name"])
            break
        time.sleep(0.05)  # poll interval, bounded by the loop count
    r.note("listed", bool(name))
    r.names["conn"] = name
    call(r, "GET", "/api/connections")
    call(r, "GET", f"/api/connections/{q(name)}")
    call(r, "GET", f"/api/connections/{q(name)}/channels")
    call(r, "GET", "/api/channels")
    call(r, "GET", "/api/consumers")
    call(r, "GET", "/api/consumers/%2F")
    call(r, "GET", f"/api/queues/%2F/{q(qn)}")  # consumer_details
    call(r, "GET", "/api/vhosts/%2F/connections")
    call(r, "DELETE", f"/api/connections/{q(name)}")
    c.until("Connection.Close")
    # RabbitMQ 3.10 answers 500 to a DELETE of a connection whose process is gone while its
    # stats entry lingers: wait until the API no longer shows it (bounded poll), then compare.
    for _ in range(200):
        if call(r, "GET", f"/api/connections/{q(name)}", keys=False, record=False)[0] == 404:
            break
        time.sleep(0.05)
    call(r, "DELETE", f"/api/connections/{q(name)}")


@scenario
def definitions_import(r: Run) -> None:
    vh = r.name("vh")
    doc = {"vhosts": [{"name": vh}],
           "queues": [{"name": "q1", "vhost": vh, "durable": True, "auto_delete": False,
                       "arguments": {"x-queue-type": "quorum"}}],
           "exchanges": [{"name": "x1", "vhost": vh, "type": "topic", "durable": True,
                          "auto_delete": False, "internal": False, "arguments": {}}],
           "bindings": [{"source": "x1", "vhost": vh, "destination": "q1", "destination_type": "queue",
                         "routing_key": "#", "arguments": {}}],
           "policies": [{"vhost": vh, "name": "p", "pattern": "^q", "apply-to": "queues",
                         "definition": {"max-length": 10}, "priority": 0}]}
    call(r, "POST", "/api/definitions", doc)
    call(r, "GET", f"/api/definitions/{q(vh)}")
    call(r, "GET", f"/api/queues/{q(vh)}/q1")
    call(r, "GET", f"/api/bindings/{q(vh)}")
    call(r, "POST", f"/api/definitions/{q(vh)}", {"queues": [{"name": "q2", "durable": True,
                                                             "auto_delete": False, "arguments": {}}]})
    call(r, "GET", f"/api/queues/{q(vh)}/q2")
    call(r, "POST", "/api/definitions", raw=b"{not json")
    call(r, "DELETE", f"/api/vhosts/{q(vh)}")


def _stats_keys(r: Run, path: str) -> set[str]:
    _, body = call(r, "GET", path, record=False)
    return set(keys_of(body) or ())


@scenario
def message_stats_and_rates(r: Run) -> None:
    """Traffic through an exchange into a queue of a fresh vhost, gets and a redelivery, then the
    statistics every dashboard reads: exchange publish_in/out, the queue's, vhost's, overview's and
    node's counters with their ``*_details`` rates, churn rates. RabbitMQ emits statistics every
    collect_statistics_interval, so both brokers are polled until the counters appear."""
    vh, xn, qn = q(r.name("vh")), r.name("x"), r.name("q")
    call(r, "PUT", f"/api/vhosts/{vh}", {})
    call(r, "PUT", f"/api/permissions/{vh}/guest", {"configure": ".*", "write": ".*", "read": ".*"})
    call(r, "PUT", f"/api/exchanges/{vh}/{q(xn)}", {"type": "fanout", "durable": False})
    call(r, "PUT", f"/api/queues/{vh}/{q(qn)}", {"durable": False})
    call(r, "POST", f"/api/bindings/{vh}/e/{q(xn)}/q/{q(qn)}", {"routing_key": ""})
    for _ in range(3):
        call(r, "POST", f"/api/exchanges/{vh}/{q(xn)}/publish",
             {"routing_key": "", "payload": "m", "payload_encoding": "string", "properties": {}},
             record=False)
    for _ in range(2):  # the second get takes the requeued message again: a redelivery
        call(r, "POST", f"/api/queues/{vh}/{q(qn)}/get",
             {"count": 1, "ackmode": "ack_requeue_true", "encoding": "auto"}, record=False)
    wanted = {f"/api/exchanges/{vh}/{q(xn)}": {"message_stats.publish_in", "message_stats.publish_out"},
              f"/api/queues/{vh}/{q(qn)}": {"message_stats.get", "message_stats.redeliver"},
              f"/api/vhosts/{vh}": {"message_stats.get", "message_stats.redeliver"}}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(
            not want <= _stats_keys(r, path) for path, want in wanted.items()):
        time.sleep(0.2)
    for path in (*wanted, f"/api/exchanges/{vh}", "/api/overview", "/api/nodes"):
        call(r, "GET", path)
    call(r, "DELETE", f"/api/vhosts/{vh}")


@scenario
def healthchecks_node(r: Run) -> None:
    node = node_name(r)
    call(r, "GET", "/api/healthchecks/node")
    call(r, "GET", f"/api/healthchecks/node/{q(node)}")
    call(r, "GET", "/api/healthchecks/node", auth=None)


@scenario
def parameters_delete_missing(r: Run) -> None:
    for component in ("federation-upstream", "shovel", "no-such-component"):
        call(r, "DELETE", f"/api/parameters/{component}/%2F/{q(r.name('p'))}")
    call(r, "DELETE", f"/api/parameters/federation-upstream/no-such-vhost/{q(r.name('p'))}")


@scenario
def get_reports_message_count(r: Run) -> None:
    """Each message of a management 'get' carries the count left in the queue after it."""
    vh, qn = q("/"), r.name("q")
    call(r, "PUT", f"/api/queues/{vh}/{q(qn)}", {"durable": False, "auto_delete": False})
    for i in range(4):
        call(r, "POST", f"/api/exchanges/{vh}/amq.default/publish",
             {"routing_key": qn, "payload": f"m{i}", "payload_encoding": "string", "properties": {}},
             record=False)
    for mode in ("ack_requeue_true", "ack_requeue_false"):
        status, got = call(r, "POST", f"/api/queues/{vh}/{q(qn)}/get",
                           {"count": 3, "ackmode": mode, "encoding": "auto"})
        r.note("message_count", mode, [m.get("message_count") for m in got] if status == 200 else got)
    call(r, "DELETE", f"/api/queues/{vh}/{q(qn)}")


@scenario
def aliveness_needs_vhost_permission(r: Run) -> None:
    user = r.name("mon")
    call(r, "PUT", f"/api/users/{q(user)}", {"password": "pw", "tags": "monitoring"})
    call(r, "GET", "/api/aliveness-test/%2F", auth=(user, "pw"))
    call(r, "PUT", f"/api/permissions/%2F/{q(user)}", {"configure": ".*", "write": ".*", "read": ".*"})
    call(r, "GET", "/api/aliveness-test/%2F", auth=(user, "pw"))
    call(r, "PUT", f"/api/users/{q(user)}", {"password": "pw", "tags": "management"})
    call(r, "GET", "/api/aliveness-test/%2F", auth=(user, "pw"))
    call(r, "DELETE", f"/api/users/{q(user)}")


@scenario
def cli_rabbitmqadmin(r: Run) -> None:
    status, body = call(r, "GET", "/cli/rabbitmqadmin", auth=None, keys=False)
    r.note("served a Python script", status == 200 and str(body).startswith("#!/usr/bin/env python"))


@scenario
def grants_api(r: Run) -> None:
    """Topic permissions, user limits and global parameters: statuses and key sets."""
    user, vh, param = r.name("user"), q("/"), r.name("param")
    call(r, "PUT", f"/api/users/{q(user)}", {"password": "pw", "tags": ""})
    tp = f"/api/topic-permissions/{vh}/{q(user)}"
    call(r, "GET", tp)
    call(r, "PUT", tp, {"exchange": "amq.topic", "write": "^a", "read": "^b"})
    call(r, "PUT", tp, {"exchange": "amq.topic", "write": "^a", "read": "^c"})
    call(r, "PUT", f"/api/topic-permissions/{vh}/{q(r.name('nobody'))}",
         {"exchange": "amq.topic", "write": "", "read": ""})
    for path in (tp, "/api/topic-permissions", f"/api/users/{q(user)}/topic-permissions",
                 f"/api/vhosts/{vh}/topic-permissions"):
        call(r, "GET", path)
    call(r, "DELETE", tp)
    call(r, "GET", tp)
    call(r, "PUT", f"/api/user-limits/{q(user)}/max-connections", {"value": 5})
    call(r, "PUT", f"/api/user-limits/{q(user)}/max-connections", {"value": 6})
    call(r, "GET", f"/api/user-limits/{q(user)}", values=True)
    call(r, "GET", "/api/user-limits")
    call(r, "GET", f"/api/users/{q(user)}")
    call(r, "DELETE", f"/api/user-limits/{q(user)}/max-connections")
    call(r, "GET", f"/api/user-limits/{q(user)}", values=True)
    call(r, "PUT", f"/api/global-parameters/{q(param)}", {"value": {"a": [1, 2]}})
    call(r, "PUT", f"/api/global-parameters/{q(param)}", {"value": {"a": [1, 3]}})
    call(r, "GET", f"/api/global-parameters/{q(param)}", values=True)
    call(r, "GET", "/api/global-parameters")
    call(r, "DELETE", f"/api/global-parameters/{q(param)}")
    call(r, "GET", f"/api/global-parameters/{q(param)}")
    call(r, "DELETE", f"/api/users/{q(user)}")
