"""Policies and operator policies of one vhost.

Theory of operation
-------------------
A policy is (name, pattern, definition, priority, apply-to). It applies to a
queue or exchange whose name matches the pattern (a regex, searched anywhere
in the name as RabbitMQ does) when apply-to allows that kind; of all matching
policies the one with the highest priority wins (ties: the name sorting
first). Operator policies are a second, independent set whose numeric limits
cap whatever the queue arguments and the user policy say (the lowest wins, see
``features.effective_config``).

The set is persisted as ``policies.json`` in the vhost directory, replaced
whole (tmp + fsync + rename, reported to the replication sink) on every change;
the vhost re-applies the effective definitions to every existing queue and
exchange right after a change, so policies act live.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from broker import errors
from broker.errors import StoreError
from broker.model import features, queue_featured, queue_types
from broker.model.exchange import Exchange
from broker.model.features import CallLater, validate_policy_definition
from broker.model.publish_api import Republisher
from broker.model.queue import ClassicQueue, Queue
from broker.model.stream import StreamQueue, check_policy_definition
from broker.patterns import Pattern, PatternError, compile_pattern
from broker.store.jsonstore import read_json, write_json
from broker.store.sink import ReplicationSink

log = logging.getLogger(__name__)

APPLY_TO = ("all", "queues", "exchanges", "classic_queues", "quorum_queues", "streams")
_QUEUE_KINDS = ("all", "queues", "classic_queues", "quorum_queues")
_STREAM_KINDS = ("all", "queues", "streams")  # apply-to values that reach stream queues
FILE_VERSION = 1


@dataclass(frozen=True)
class Policy:
    name: str
    pattern: str
    definition: dict[str, Any]
    priority: int
    apply_to: str
    regex: Pattern

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "pattern": self.pattern, "definition": self.definition,
                "priority": self.priority, "apply-to": self.apply_to}

    def applies(self, kind: str, name: str) -> bool:
        if kind == "queue" and self.apply_to not in _QUEUE_KINDS:
            return False
        if kind == "stream" and self.apply_to not in _STREAM_KINDS:
            return False
        if kind == "exchange" and self.apply_to not in ("all", "exchanges"):
            return False
        return self.regex.search(name)


def make_policy(name: str, pattern: str, definition: dict[str, Any], priority: int = 0,
                apply_to: str = "all") -> Policy:
    """A validated policy; ValueError names what is wrong."""
    if not name or len(name.encode()) > 255:
        raise ValueError("policy name must be 1 to 255 bytes")
    if not isinstance(pattern, str):
        raise ValueError("'pattern' must be a string")
    try:
        regex = compile_pattern(pattern)
    except PatternError as exc:
        raise ValueError(f"invalid pattern regex: {exc}") from None
    if not isinstance(definition, dict) or not definition:
        raise ValueError("'definition' must be a non-empty object")
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError("'priority' must be an integer")
    if apply_to not in APPLY_TO:
        raise ValueError(f"'apply-to' must be one of {', '.join(APPLY_TO)}")
    validate_policy_definition(definition)
    check_policy_definition(definition)  # max-age (stream retention)
    return Policy(name, pattern, dict(definition), priority, apply_to, regex)


class PolicySet:
    def __init__(self, path: Path, sink: ReplicationSink) -> None:
        self.path = path
        self.sink = sink
        self.policies: dict[str, Policy] = {}
        self.operator: dict[str, Policy] = {}
        self.unrunnable: dict[str, list[Any]] = {}  # entries whose pattern RE2 refuses, as read
        data = read_json(path, None)
        if data is None:
            return
        try:
            for key, target in (("policies", self.policies), ("operator_policies", self.operator)):
                for e in data.get(key, []):
                    if isinstance(e.get("pattern"), str):
                        try:
                            compile_pattern(e["pattern"])
                        except PatternError as exc:  # set before patterns moved to RE2
                            log.error("%s: %s '%s' not applied (set it again with a pattern RE2 "
                                      "runs): %s", path, key[:-3] + "y", e.get("name"), exc)
                            self.unrunnable.setdefault(key, []).append(e)  # kept in the file
                            continue
                    target[e["name"]] = make_policy(e["name"], e["pattern"], e["definition"],
                                                    int(e.get("priority", 0)), e.get("apply-to", "all"))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise StoreError(f"{path}: malformed policies file ({exc})") from None

    def save(self) -> None:
        write_json(self.path, {
            "version": FILE_VERSION,
            "policies": [p.to_json() for _, p in sorted(self.policies.items())]
            + [e for e in self.unrunnable.get("policies", []) if e["name"] not in self.policies],
            "operator_policies": [p.to_json() for _, p in sorted(self.operator.items())]
            + [e for e in self.unrunnable.get("operator_policies", []) if e["name"] not in self.operator],
        }, self.sink)

    @staticmethod
    def _match(policies: dict[str, Policy], kind: str, name: str) -> Policy | None:
        best: Policy | None = None
        for p in policies.values():
            if p.applies(kind, name) and (best is None or p.priority > best.priority
                                          or (p.priority == best.priority and p.name < best.name)):
                best = p
        return best

    def for_queue(self, name: str, kind: str = "queue") -> tuple[Policy | None, Policy | None]:
        """(policy, operator policy) in effect for queue ``name`` (kind ``stream`` for streams)."""
        if not self.policies and not self.operator:
            return None, None
        return self._match(self.policies, kind, name), self._match(self.operator, kind, name)

    def for_exchange(self, name: str) -> Policy | None:
        if not self.policies:
            return None
        return self._match(self.policies, "exchange", name)


# ------------------------------------------------------------------ applying
def read_legacy(path: Path) -> Any:
    """The parsed node-wide ``policies.json`` of older releases, or None when there is none."""
    return read_json(path, None)


class Scope(Republisher, Protocol):
    """What applying policies reads of the vhost whose queues and exchanges they reach
    (``VHost`` is one), which is also the publish operation a featured queue's dead letters
    go through."""

    @property
    def name(self) -> str: ...

    @property
    def policy_set(self) -> PolicySet: ...

    @property
    def queues(self) -> Mapping[str, Queue]: ...

    @property
    def exchanges(self) -> Mapping[str, Exchange]: ...

    @property
    def call_later(self) -> CallLater | None: ...


def apply_to_queue(vh: Scope, q: Queue, args_cfg: features.QueueConfig | None = None) -> None:
    """Give ``q`` the config its arguments and the vhost's policies add up to (``args_cfg``:
    its arguments as ``features.parse_arguments`` read them, if the caller has just done so)."""
    if q.arguments.get("x-queue-type") == "stream":
        if isinstance(q, StreamQueue):
            apply_stream_policies(vh, q)  # retention limits
        return
    if not isinstance(q, ClassicQueue):
        return
    pol, op = vh.policy_set.for_queue(q.name)
    if args_cfg is None:
        try:
            args_cfg = features.parse_arguments(q.arguments, q.name, vh.name)
        except errors.PreconditionFailed:
            args_cfg = features.QueueConfig()
    default_limit = queue_types.default_delivery_limit(q.arguments)  # quorum: 20 unless set
    if default_limit is not None and args_cfg.delivery_limit is None and not any(
            p is not None and "delivery-limit" in p.definition for p in (pol, op)):
        args_cfg = replace(args_cfg, delivery_limit=default_limit)
    queue_featured.attach(vh, q, args_cfg, pol.definition if pol else None,
                    op.definition if op else None, vh.call_later)


def apply_stream_policies(vh: Scope, q: StreamQueue) -> None:
    """Give ``q`` the retention its arguments and the vhost's (operator) policies add up to."""
    pol, op = vh.policy_set.for_queue(q.name, "stream")
    q.apply_policies(pol.definition if pol else None, op.definition if op else None)


def apply_to_exchange(vh: Scope, ex: Exchange) -> None:
    """alternate-exchange: the argument wins over a policy."""
    arg = ex.arguments.get("alternate-exchange")
    if arg:
        ex.alternate = str(arg)
        return
    pol = vh.policy_set.for_exchange(ex.name)
    alt = pol.definition.get("alternate-exchange") if pol is not None else None
    ex.alternate = str(alt) if alt else None


def apply_all(vh: Scope) -> None:
    for q in list(vh.queues.values()):
        if not q.deleted:
            apply_to_queue(vh, q)
    for ex in list(vh.exchanges.values()):
        apply_to_exchange(vh, ex)


def set_policy(vh: Scope, name: str, pattern: str, definition: dict[str, Any], priority: int = 0,
               apply_to: str = "all", operator: bool = False) -> None:
    p = make_policy(name, pattern, definition, priority, apply_to)
    target = vh.policy_set.operator if operator else vh.policy_set.policies
    old = target.get(name)
    target[name] = p
    try:
        vh.policy_set.save()
    except errors.DiskFull:  # nothing changed: the file first, then what applies
        if old is None:
            del target[name]
        else:
            target[name] = old
        raise
    apply_all(vh)


def delete_policy(vh: Scope, name: str, operator: bool = False) -> bool:
    target = vh.policy_set.operator if operator else vh.policy_set.policies
    old = target.pop(name, None)
    if old is None:
        return False
    try:
        vh.policy_set.save()
    except errors.DiskFull:
        target[name] = old
        raise
    apply_all(vh)
    return True
