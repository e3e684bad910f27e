"""Answers of the management API made of several parts: a node's workers
(``broker/shards/fanout.py``) or a cluster's serving nodes (``broker/http/forward.py``).

Each part is what one broker holds; the shard map gives each vhost exactly one of them, so the
per-vhost facts of the parts are disjoint and the whole is their sum: counts added
(``add_counts``), Prometheus samples of one name and labels added (``merge_metrics``), lists
concatenated, definitions merged (``merge_exports``). Facts every part states alike (the shared
state: users, permissions, the vhost list; a node's identity series) are taken once.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Final

SUMMED: Final = ("object_totals", "queue_totals", "message_stats")  # the overview's count sections
PER_VHOST: Final = ("vhosts", "parameters", "policies", "queues", "exchanges", "bindings")
VHOST_NAMED: Final = ("permissions", "topic_permissions", "parameters", "policies", "queues", "exchanges",
                      "bindings")


def add_counts(into: dict[str, Any], other: dict[str, Any]) -> None:
    """Add ``other``'s numbers under the overview's count sections to ``into``'s."""
    for key in SUMMED:
        if isinstance(into.get(key), dict) and isinstance(other.get(key), dict):
            _add(into[key], other[key])
        elif key not in into and key in other:
            into[key] = other[key]


def _add(into: dict[str, Any], other: dict[str, Any]) -> None:
    for k, v in other.items():
        mine = into.get(k)
        if isinstance(v, bool) or isinstance(mine, bool):
            continue
        if isinstance(v, (int, float)) and isinstance(mine, (int, float)):
            into[k] = mine + v
        elif isinstance(v, dict) and isinstance(mine, dict):
            _add(mine, v)
        elif k not in into:
            into[k] = v


def merge_metrics(texts: list[str]) -> str:
    """Prometheus text of several parts as one answer: samples of the same name and labels
    added up (counters and gauges of the parts), except ``*_info``, start times and leadership,
    which are the same fact in every part (the first is kept)."""
    order: list[str] = []
    values: dict[str, float] = {}
    for text in texts:
        for line in text.splitlines():
            if not line or line.startswith("#"):
                if line and line not in values and line not in order:
                    order.append(line)
                continue
            key, _, raw = line.rpartition(" ")
            try:
                value = float(raw)
            except ValueError:
                continue
            if key not in values:
                order.append(key)
                values[key] = value
            elif not _same_fact(key):
                values[key] += value
    out = []
    for key in order:
        if key in values:
            v = values[key]
            out.append(f"{key} {int(v) if v.is_integer() and abs(v) < 1e15 else v!r}")
        else:
            out.append(key)
    return "\n".join(out) + "\n"


def _same_fact(key: str) -> bool:
    name = key.split("{", 1)[0]
    return name.endswith("_info") or "start_time" in name or name.endswith("_is_leader")


def named_vhosts(doc: Any) -> set[str]:
    """The vhosts a definitions document's entries name (empty: users and global state only)."""
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
    return names


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
    return (str(entry.get("vhost", "")),)  # policies, parameters: each part's order kept (stable)


def merge_exports(mine: dict[str, Any], others: list[dict[str, Any]]) -> dict[str, Any]:
    """The whole definitions from one part's export and the other parts': the shared keys of
    ``mine``, the per-vhost lists of all of them concatenated, an entry stated alike by
    several parts (the vhost list, which every node of a cluster holds) once, then sorted as a
    single broker sorts them (by vhost, then name), so export -> wipe -> import -> export
    gives the identical document."""
    doc = dict(mine)
    for kind in PER_VHOST:
        items: list[Any] = []
        seen: set[str] = set()
        for part in (mine, *others):
            for entry in part.get(kind) or []:
                same = json.dumps(entry, sort_keys=True)
                if same not in seen:
                    seen.add(same)
                    items.append(entry)
        doc[kind] = sorted(items, key=functools.partial(_key, kind))
    return doc
