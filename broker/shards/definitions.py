"""Definitions export and import of a multi-worker node.

Theory of operation
-------------------
Each worker exports what it holds (``broker.http.definitions.export``): the shared state (users,
permissions, topic permissions, global parameters: the node's one copy, the same in every
worker) and its own vhosts with their topology (vhosts, queues, exchanges, bindings, policies,
vhost parameters). The shard map gives each vhost exactly one worker, so the per-vhost lists of
the parts are disjoint: the node's document is the shared keys of one part and the per-vhost
lists of all of them concatenated, then sorted as a single worker sorts them (by vhost, then
name), so export -> wipe -> import -> export still gives the identical document. A part that
is missing (its worker restarting) would make a document without that worker's vhosts, which
an import elsewhere would take for the whole node: the caller answers an error instead.

An import is all or nothing on one worker (``broker.http.definitions``: validated whole, written
down, undone on failure, completed after a crash), not across several. So a document is taken
when every entry that names a vhost (vhosts, permissions, topic permissions, queues, exchanges,
bindings, policies, parameters) names vhosts of one worker: it goes whole to that worker, whose
own import is the all-or-nothing one (users and global parameters are the node's shared files,
which any worker writes). A document whose vhosts span workers is refused (501) before anything
happens: it is imported per vhost (``/api/definitions/{vhost}``) or on a node of one worker.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

PER_VHOST = ("vhosts", "parameters", "policies", "queues", "exchanges", "bindings")


VHOST_NAMED = ("permissions", "topic_permissions", "parameters", "policies", "queues", "exchanges",
               "bindings")


def owners(doc: Any, owner: Callable[[str], int]) -> set[int]:
    """The workers owning the vhosts ``doc``'s entries name (empty: users and global state only)."""
    if not isinstance(doc, dict):
        return set()
    names: set[str] = set()
    for entry in doc.get("vhosts") or []:
        if isinstance(entry, dict) and isinstance(entry.get("name"), str):
            names.add(entry["name"])
    for kind in VHOST_NAMED:
        for entry in doc.get(kind) or []:
            if isinstance(entry, dict) and isinstance(entry.get("vhost"), str):
                names.add(entry["vhost"])
    return {owner(name) for name in names}


def _key(kind: str, entry: Any) -> tuple[str, ...]:
    if not isinstance(entry, dict):
        return ("",)
    if kind == "vhosts":
        return (str(entry.get("name", "")),)
    if kind == "bindings":
        fields = ("vhost", "source", "destination_type", "destination", "routing_key")
        return (*(str(entry.get(f, "")) for f in fields), repr(entry.get("arguments")))
    if kind in ("queues", "exchanges"):
        return (str(entry.get("vhost", "")), str(entry.get("name", "")))
    return (str(entry.get("vhost", "")),)  # policies, parameters: each worker's order kept (stable)


def merge_exports(mine: dict[str, Any], others: list[dict[str, Any]]) -> dict[str, Any]:
    """The node's definitions from this worker's export and the other workers' (module doc)."""
    doc = dict(mine)
    for kind in PER_VHOST:
        items: list[Any] = list(doc.get(kind) or [])
        for other in others:
            items.extend(other.get(kind) or [])
        doc[kind] = sorted(items, key=functools.partial(_key, kind))
    return doc
