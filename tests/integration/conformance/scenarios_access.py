"""AMQP scenarios that need users, permissions and limits (set up over the management API).

Each scenario creates its own vhost and user through the HTTP API (not recorded: only what the
AMQP client then sees is compared) and deletes them at the end.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from pamqp import commands as C

from ._steps import declare_q, declare_x, get, scenario
from ._wire import Run
from .scenarios_http import call, q


@contextmanager
def tenant(r: Run, configure: str, write: str, read: str,
           limits: dict[str, int] | None = None, tags: str = "") -> Iterator[tuple[str, str]]:
    """A fresh vhost and user with these permissions (and vhost limits); removed afterwards."""
    vh, user = r.name("vh"), r.name("user")
    call(r, "PUT", f"/api/vhosts/{q(vh)}", {}, record=False)
    call(r, "PUT", f"/api/users/{q(user)}", {"password": "pw", "tags": tags}, record=False)
    call(r, "PUT", f"/api/permissions/{q(vh)}/{q(user)}",
         {"configure": configure, "write": write, "read": read}, record=False)
    for name, value in (limits or {}).items():
        call(r, "PUT", f"/api/vhost-limits/{q(vh)}/{name}", {"value": value}, record=False)
    try:
        yield vh, user
    finally:
        r.close()
        call(r, "DELETE", f"/api/vhosts/{q(vh)}", record=False)
        call(r, "DELETE", f"/api/users/{q(user)}", record=False)


@scenario
def access_configure_write_read(r: Run) -> None:
    """configure ^mine, write ^mine, read ^mine: every method's permission check and its ids."""
    with tenant(r, "^mine", "^mine", "^mine") as (vh, user):
        c = r.conn(user=user, password="pw", vhost=vh)
        declare_q(c, "mine.q")
        declare_x(c, "mine.x", "fanout", auto_delete=True)
        steps = [C.Queue.Declare(queue="other.q"), C.Exchange.Declare(exchange="other.x"),
                 C.Queue.Declare(queue="other.q", passive=True),
                 C.Queue.Bind(queue="mine.q", exchange="amq.fanout"),  # read on amq.fanout
                 C.Queue.Delete(queue="other.q"), C.Queue.Purge(queue="other.q"),
                 C.Basic.Get(queue="other.q"), C.Basic.Consume(queue="other.q"),
                 C.Exchange.Delete(exchange="other.x"),
                 C.Exchange.Bind(destination="mine.x", source="amq.direct")]
        for step in steps:
            c.call(1, step)
            if c.run.transcript[-1][2] == "Channel.Close":
                c.call(1, C.Channel.Open())
        c.publish(1, "amq.direct", "k", b"no write on amq.direct")
        c.until("Channel.Close")
        c.call(1, C.Channel.Open())
        c.publish(1, "mine.x", "", b"write on mine.x is fine")
        c.call(1, C.Queue.Bind(queue="mine.q", exchange="mine.x"))
        c.publish(1, "mine.x", "", b"routed")
        get(c, "mine.q")
        c.call(1, C.Queue.Delete(queue="mine.q"))
        c.close()


@scenario
def access_vhost_refused(r: Run) -> None:
    with tenant(r, ".*", ".*", ".*") as (vh, user):
        call(r, "DELETE", f"/api/permissions/{q(vh)}/{q(user)}", record=False)
        c = r.conn(user=user, password="pw", vhost=vh)
        if not c.closed:
            c.until("Connection.Close")
        c = r.conn(user=user, password="pw", vhost="/")  # no permissions there either
        if not c.closed:
            c.until("Connection.Close")


@scenario
def vhost_limits(r: Run) -> None:
    with tenant(r, ".*", ".*", ".*", {"max-connections": 1, "max-queues": 1}) as (vh, user):
        c = r.conn(user=user, password="pw", vhost=vh)
        declare_q(c, "q1")
        declare_q(c, "q2")
        c.call(1, C.Channel.Open())
        declare_q(c, "q1")  # a redeclare is not a new queue
        second = r.conn(user=user, password="pw", vhost=vh)
        if not second.closed:
            second.until("Connection.Close")
        c.call(1, C.Queue.Delete(queue="q1"))
        c.close()


@scenario
def access_impersonator_user_id(r: Run) -> None:
    """A user tagged ``impersonator`` may publish with another user's user_id (the property is
    kept); the same publish from an untagged user is 406 (``basic_publish_wrong_user_id``)."""
    with tenant(r, ".*", ".*", ".*", tags="impersonator") as (vh, user):
        c = r.conn(user=user, password="pw", vhost=vh)
        declare_q(c, "imp.q")
        c.publish(1, "", "imp.q", b"on behalf", C.Basic.Properties(user_id="someone-else"))
        get(c, "imp.q")
        c.close()


@scenario
def access_topic_permissions(r: Run) -> None:
    """A topic permission on amq.topic (write ^pub\\., read ^{username}\\.): publishes and binds
    with other routing keys are 403; other exchanges are not affected."""
    with tenant(r, ".*", ".*", ".*") as (vh, user):
        call(r, "PUT", f"/api/topic-permissions/{q(vh)}/{q(user)}",
             {"exchange": "amq.topic", "write": "^pub\\.", "read": "^{username}\\."}, record=False)
        c = r.conn(user=user, password="pw", vhost=vh)
        declare_q(c, "tq")
        c.call(1, C.Queue.Bind(queue="tq", exchange="amq.topic", routing_key=f"{user}.#"))
        c.call(1, C.Queue.Bind(queue="tq", exchange="amq.topic", routing_key="someone.#"))
        c.call(1, C.Channel.Open())
        c.call(1, C.Queue.Unbind(queue="tq", exchange="amq.topic", routing_key="someone.#"))
        c.call(1, C.Channel.Open())
        c.call(1, C.Queue.Bind(queue="tq", exchange="amq.direct", routing_key="anything"))
        c.call(1, C.Confirm.Select())
        c.publish(1, "amq.topic", "pub.1", b"allowed")
        c.recv(1)
        c.publish(1, "amq.topic", "other.1", b"refused")
        c.until("Channel.Close")
        c.close()


@scenario
def access_user_limits(r: Run) -> None:
    with tenant(r, ".*", ".*", ".*") as (vh, user):
        call(r, "PUT", f"/api/user-limits/{q(user)}/max-channels", {"value": 2}, record=False)
        c = r.conn(user=user, password="pw", vhost=vh)
        c.call(2, C.Channel.Open())
        c.call(3, C.Channel.Open())
        if not c.closed:
            c.until("Connection.Close")
        call(r, "PUT", f"/api/user-limits/{q(user)}/max-connections", {"value": 0}, record=False)
        c2 = r.conn(user=user, password="pw", vhost=vh, open_channel=None)
        if not c2.closed:
            c2.until("Connection.Close")
