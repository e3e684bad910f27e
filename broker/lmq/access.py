"""Who an LMQ request acts as, and the AMQP permission each LMQ operation needs.

Theory of operation
-------------------
Both LMQ front ends log in with the broker's users and the one login throttle
(``broker.auth.throttle.check_login``, keyed on source and user): HTTP with basic auth on every
request, MessagePack-RPC with ``authenticate(user, password)`` as a connection's first call.
With ``[lmq] auth = false`` (LMQ's anonymous mode, an operator's choice) a request without
credentials acts as ``[lmq] anonymous_user``: that user must exist, may be loopback-only like
``guest``, and only its permissions apply. Either way the user needs access to the LMQ vhost.

Every operation is then checked as the AMQP operations it stands for would be, with the same
configure/write/read regexes (``UserStore.can_*``):

=====================================  ==============================================
LMQ operation                          AMQP equivalent -> permission
=====================================  ==============================================
a put / push (also creating the queue) basic.publish to the default exchange -> write
                                       on ``amq.default``; queue.declare of a queue
                                       that does not exist yet -> configure on it
a take / pull, ack, nack, ext          basic.get and its settlement -> read on the queue
``qre`` take / ``pull_any``            read on each queue; queues it may not read are
                                       not candidates (as if absent)
``qre`` put / ``push_all``             write on ``amq.default`` (one publish per queue)
delete a queue                         queue.delete -> configure on the queue
set a queue's properties               queue arguments -> configure on the queue
set or clear the default rules         they apply to every queue of the vhost, like a
                                       policy -> the ``administrator`` or ``policymaker``
                                       tag, as policies require
read properties                        vhost access
=====================================  ==============================================

A refusal is ``LMQError(403)`` (an RPC error string), raised before anything changes.
"""

from __future__ import annotations

from dataclasses import dataclass

from broker.auth.users import User, UserStore

DEFAULT_EXCHANGE = ""  # checked under the name amq.default, as AMQP's publish is
POLICY_TAGS = frozenset({"administrator", "policymaker"})


class Refused(Exception):
    """A request the user may not make; ``status`` is the HTTP status (401 or 403)."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class Access:
    """A logged-in user of LMQ's vhost: every check looks the user up afresh, so a changed or
    deleted user's permissions apply at once, as they do over AMQP."""

    users: UserStore
    user: User | str  # a token's user carries its own grants (broker.auth.oauth)
    vhost: str

    @property
    def name(self) -> str:
        return self.user if isinstance(self.user, str) else self.user.name

    def _check(self, allowed: bool, what: str, kind: str, name: str) -> None:
        if not allowed:
            shown = name or "amq.default"
            raise Refused(403, f"access to {kind} '{shown}' in vhost '{self.vhost}' refused for user "
                               f"'{self.name}' ({what} permission needed)")

    def configure(self, queue: str) -> None:
        self._check(self.users.can_configure(self.user, self.vhost, queue), "configure", "queue", queue)

    def write(self, exchange: str = DEFAULT_EXCHANGE) -> None:
        self._check(self.users.can_write(self.user, self.vhost, exchange), "write", "exchange", exchange)

    def read(self, queue: str) -> None:
        self._check(self.users.can_read(self.user, self.vhost, queue), "read", "queue", queue)

    def may_read(self, queue: str) -> bool:
        return self.users.can_read(self.user, self.vhost, queue)

    def set_policy(self) -> None:
        u = self.users.resolve(self.user)
        if u is None or not POLICY_TAGS.intersection(u.tags):
            raise Refused(403, f"access refused: user '{self.name}' may not set LMQ's default properties "
                               "(they apply to every queue, like a policy: administrator or policymaker "
                               "tag needed)")


def logged_in(users: UserStore, user: User | str, vhost: str) -> Access:
    """``user``'s access to ``vhost`` after a successful login; Refused(403) without vhost access."""
    if not users.has_vhost_access(user, vhost):
        name = user if isinstance(user, str) else user.name
        raise Refused(403, f"user '{name}' has no access to vhost '{vhost}'")
    return Access(users, user, vhost)


def anonymous(users: UserStore, user: str, source: str, vhost: str) -> Access:
    """The access of a request without credentials in LMQ's anonymous mode (``[lmq] auth`` off):
    that of ``user`` (``[lmq] anonymous_user``), when it exists and may log in from ``source``."""
    if not user or users.get(user) is None or not users.allowed_from(user, source):
        raise Refused(401, "login required (the anonymous user is not available from this address)")
    return logged_in(users, user, vhost)
