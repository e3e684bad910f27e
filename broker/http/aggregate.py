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

from aiohttp import web

from broker.http.common import error_response

SUMMED: Final = ("object_totals", "queue_totals", "message_stats")  # the overview's count sections
PER_VHOST: Final = ("vhosts", "parameters", "policies", "queues", "exchanges", "bindings")
VHOST_NAMED: Final = ("permissions", "topic_permissions", "parameters", "policies", "queues", "exchanges",
                      "bindings")


def partial(missing: list[str]) -> web.Response:
    """The answer when a part is missing (``missing`` says which): 503, never a whole that
    under-counts (an overview says it in its ``partial`` list instead)."""
    why = "part of the answer is missing, retry: " + "; ".join(missing)
    return error_response(503, "service_unavailable", why)


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


# samples that state one fact every part shares (the node's identity, the cluster's users, a
# process's pid, the disk under the data dir and its limits): the first part's is kept
SAME_FACT: Final = ("_info", "start_time", "_is_leader", "_users", "uptime_seconds", "_pid",
                    "disk_space_available_bytes", "_limit_bytes", "_max_fds", "_max_tcp_sockets")
# samples about one node's process and its replication, not about the shards (a cluster's other
# nodes export their own on their metrics ports): only the first part's, across nodes
NODE_OWN: Final = ("_identity_info", "process_", "disk_space_", "resident_memory_", "erlang_uptime",
                   "uptime_seconds", "connected_followers", "follower_lag", "alarms_", "_is_leader")


def merge_metrics(texts: list[str], nodes: bool = False) -> str:
    """Prometheus text of several parts as one answer: samples of the same name and labels
    added up (counters and gauges of the parts), except those of one fact (``SAME_FACT``:
    the first kept), and across ``nodes`` those of one node (``NODE_OWN``: the first part's
    only). A family's samples stay together under its ``# HELP`` and ``# TYPE`` (each part
    lists its samples after them; the text format wants a family in one group)."""
    heads: dict[str, list[str]] = {}  # family -> its comment lines, from the first part naming it
    samples: dict[str, list[str]] = {}  # family -> sample keys, first seen first
    values: dict[str, float] = {}
    for n, text in enumerate(texts):
        family = ""
        for line in text.splitlines():
            if line.startswith("#"):
                parts = line.split(" ", 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    lines = heads.setdefault(family, [])
                    if not any(had.split(" ", 2)[1] == parts[1] for had in lines):
                        lines.append(line)  # the first part's HELP and TYPE of the family
                continue
            key, _, raw = line.rpartition(" ")
            try:
                value = float(raw)
            except ValueError:
                continue
            name = key.split("{", 1)[0]
            if n and nodes and any(mark in name for mark in NODE_OWN):
                continue
            heads.setdefault(family, [])
            if key not in values:
                samples.setdefault(family, []).append(key)
                values[key] = value
            elif n and not any(mark in name for mark in SAME_FACT):
                values[key] += value
    out: list[str] = []
    for family, lines in heads.items():
        out.extend(lines)
        for key in samples.get(family, ()):
            v = values[key]
            out.append(f"{key} {int(v) if v.is_integer() and abs(v) < 1e15 else v!r}")
    return "\n".join(out) + "\n"


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
