"""Definitions export of a multi-worker node: every worker's part as one document.

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
"""

from __future__ import annotations

import functools
from typing import Any

PER_VHOST = ("vhosts", "parameters", "policies", "queues", "exchanges", "bindings")


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
