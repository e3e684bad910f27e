"""The parts of a definitions document kept beside users and vhosts: topic permissions, user
limits (``users[].limits``) and global parameters.

Validated with the rest of the document (``definitions.validate`` calls ``validate``), so a bad
entry refuses the whole import before anything changes, and applied after users and
permissions exist (``definitions.apply`` calls ``apply``). Every pattern and value is checked by
the same code that checks it on the API (``TopicPermission``, ``check_limit``,
``GlobalParameters.check``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from broker.auth.parameters import GlobalParameters
from broker.auth.users import TopicPermission, check_limit
from broker.http.state import Mgmt


class GrantsError(ValueError):
    """A bad entry: ``where`` names it as the definitions error does."""

    def __init__(self, where: str, what: str) -> None:
        super().__init__(f"{where}: {what}")
        self.where, self.what = where, what


@dataclass
class Grants:
    topic_permissions: list[tuple[str, str, str, str, str]] = field(default_factory=list)
    user_limits: list[tuple[str, dict[str, int]]] = field(default_factory=list)
    global_parameters: list[tuple[str, Any]] = field(default_factory=list)


def _entries(doc: dict[str, Any], key: str) -> list[dict[str, Any]]:
    value = doc.get(key) or []
    if not isinstance(value, list) or not all(isinstance(e, dict) for e in value):
        raise GrantsError(key, "must be a list of objects")
    return value


def _str(where: str, e: dict[str, Any], key: str) -> str:
    value = e.get(key)
    if not isinstance(value, str):
        raise GrantsError(where, f"'{key}' must be a string")
    return value


def validate(doc: dict[str, Any], users: set[str], vhosts: set[str]) -> Grants:
    """``users``/``vhosts``: the names that exist or that the document creates."""
    out = Grants()
    for i, e in enumerate(_entries(doc, "topic_permissions")):
        where = f"topic_permissions[{i}]"
        user, vhost, exchange, write, read = (_str(where, e, k)
                                              for k in ("user", "vhost", "exchange", "write", "read"))
        if user not in users:
            raise GrantsError(where, f"user '{user}' does not exist")
        if vhost not in vhosts:
            raise GrantsError(where, f"vhost '{vhost}' does not exist")
        try:
            TopicPermission(write, read)
        except ValueError as exc:
            raise GrantsError(where, str(exc)) from None
        out.topic_permissions.append((user, vhost, exchange, write, read))
    for i, e in enumerate(_entries(doc, "users")):
        if "limits" not in e:
            continue  # an older export: the user's limits are left as they are
        limits = e.get("limits") or {}
        if not isinstance(limits, dict):
            raise GrantsError(f"users[{i}]", "'limits' must be an object")
        try:
            for name, value in limits.items():
                check_limit(name, value)
        except ValueError as exc:
            raise GrantsError(f"users[{i}]", str(exc)) from None
        out.user_limits.append((_str(f"users[{i}]", e, "name"), dict(limits)))
    for i, e in enumerate(_entries(doc, "global_parameters")):
        where = f"global_parameters[{i}]"
        name = _str(where, e, "name")
        try:
            GlobalParameters.check(name, e.get("value"))
        except ValueError as exc:
            raise GrantsError(where, str(exc)) from None
        out.global_parameters.append((name, e["value"]))
    return out


def apply(mgmt: Mgmt, grants: Grants) -> None:
    users = mgmt.broker.users
    for user, vhost, exchange, write, read in grants.topic_permissions:
        users.set_topic_permission(user, vhost, exchange, write, read)
    for user, limits in grants.user_limits:
        found = users.get(user)
        if found is not None and dict(found.limits) != limits:
            for name in set(found.limits) - set(limits):
                users.clear_limit(user, name)
            for name, value in limits.items():
                users.set_limit(user, name, value)
    for name, value in grants.global_parameters:
        if mgmt.global_parameters.get(name) != value:
            mgmt.global_parameters.put(name, value)
