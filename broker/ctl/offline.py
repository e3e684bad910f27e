"""``skredctl definitions DATADIR``: the definitions of a stopped node, read from its files.

Theory of operation: a node keeps users and permissions in ``users.json``, the vhost list in
``vhosts.json``, and per vhost (a directory named by the SHA-1 of the name, the name inside in
``.vhost``) the durable topology as a log of AMQP method records (``definitions.amqp``), its
policies (``policies.json``), limits (``limits.json``) and metadata (``metadata.json``). This
replays each log the way the broker does at boot (declare adds, delete removes, bind and
unbind need both ends), in order, into RabbitMQ's definitions document, the one
``export_definitions`` prints from a running node. Nothing is written: a torn last record is
skipped, not trimmed, and no file is created.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pamqp import commands
from pamqp.base import Frame

from broker import __version__
from broker.errors import StoreError
from broker.model.definition_records import decode
from broker.store.definitions import read_records
from broker.store.jsonstore import read_json

DEFAULT_EXCHANGES = ("", "amq.direct", "amq.fanout", "amq.headers", "amq.match", "amq.topic")


class OfflineError(Exception):
    pass


def _json(path: Path) -> Any:
    try:
        return read_json(path, None)
    except (StoreError, OSError, ValueError) as exc:
        raise OfflineError(f"cannot read {path}: {exc}") from None


def _vhost_dirs(data_dir: Path) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for marker in sorted(data_dir.glob("*/.vhost")):
        found[marker.read_text(encoding="utf-8")] = marker.parent
    return found


class _Topology:
    """One vhost's durable exchanges, queues and bindings as the log's records leave them."""

    def __init__(self) -> None:
        self.exchanges: dict[str, dict[str, Any]] = {}
        self.queues: dict[str, dict[str, Any]] = {}
        self.bindings: list[dict[str, Any]] = []

    def _has(self, name: str) -> bool:
        return name in self.exchanges or name in DEFAULT_EXCHANGES or name.startswith("amq.")

    def _bind(self, source: str, dest: str, kind: str, m: Any, add: bool) -> None:
        """Add (bind) or remove (unbind) the binding of method ``m`` (its key and arguments)."""
        entry = {
            "source": source,
            "destination": dest,
            "destination_type": kind,
            "routing_key": m.routing_key,
            "arguments": dict(m.arguments or {}),
        }
        if add and entry not in self.bindings:
            self.bindings.append(entry)
        elif not add and entry in self.bindings:
            self.bindings.remove(entry)

    def _drop_bindings(self, name: str, kind: str) -> None:
        self.bindings = [
            b
            for b in self.bindings
            if not (b["destination_type"] == kind and b["destination"] == name)
            and not (kind == "exchange" and b["source"] == name)
        ]

    def apply(self, m: Frame) -> None:
        if isinstance(m, commands.Exchange.Declare):
            self.exchanges.setdefault(
                m.exchange,
                {
                    "name": m.exchange,
                    "type": m.exchange_type,
                    "durable": True,
                    "auto_delete": m.auto_delete,
                    "internal": m.internal,
                    "arguments": dict(m.arguments or {}),
                },
            )
        elif isinstance(m, commands.Exchange.Delete):
            if self.exchanges.pop(m.exchange, None) is not None:
                self._drop_bindings(m.exchange, "exchange")
        elif isinstance(m, commands.Queue.Declare):
            self.queues.setdefault(
                m.queue,
                {
                    "name": m.queue,
                    "durable": True,
                    "auto_delete": m.auto_delete,
                    "arguments": dict(m.arguments or {}),
                },
            )
        elif isinstance(m, commands.Queue.Delete):
            if self.queues.pop(m.queue, None) is not None:
                self._drop_bindings(m.queue, "queue")
        elif isinstance(m, commands.Queue.Bind | commands.Queue.Unbind):
            if m.queue in self.queues and self._has(m.exchange):
                self._bind(m.exchange, m.queue, "queue", m, isinstance(m, commands.Queue.Bind))
        elif isinstance(m, commands.Exchange.Bind | commands.Exchange.Unbind):
            if self._has(m.source) and self._has(m.destination):
                self._bind(m.source, m.destination, "exchange", m, isinstance(m, commands.Exchange.Bind))


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)


def definitions(data_dir_arg: str) -> dict[str, Any]:
    """RabbitMQ's definitions document of the node whose data directory is ``data_dir_arg``."""
    data_dir = Path(data_dir_arg)
    if not (data_dir / "vhosts.json").is_file() and not (data_dir / "users.json").is_file():
        raise OfflineError(f"{data_dir} is not a Skred data directory (no vhosts.json or users.json)")
    users_doc = _json(data_dir / "users.json") or {}
    listed = _json(data_dir / "vhosts.json") or {"vhosts": [{"name": "/"}]}
    dirs = _vhost_dirs(data_dir)
    names = sorted({str(v["name"]) for v in listed.get("vhosts", [])})
    doc: dict[str, Any] = {
        "rabbit_version": "3.10.0",
        "rabbitmq_version": "3.10.0",
        "product_name": "Skred",
        "product_version": __version__,
        "users": users_doc.get("users", []),
        "vhosts": [],
        "permissions": users_doc.get("permissions", []),
        "topic_permissions": users_doc.get("topic_permissions", []),
        "parameters": [],
        "policies": [],
        "queues": [],
        "exchanges": [],
        "bindings": [],
    }
    for name in names:
        vdir = dirs.get(name)
        meta = (_json(vdir / "metadata.json") if vdir else None) or {}
        doc["vhosts"].append({"name": name, **meta, "metadata": meta, "limits": []})
        if vdir is None:
            continue
        topo = _Topology()
        try:
            records = read_records(vdir / "definitions.amqp")
        except StoreError as exc:
            raise OfflineError(str(exc)) from None
        for record in records:
            try:
                method = decode(record)
            except Exception as exc:  # a bad record: the broker skips it too
                doc.setdefault("skipped_records", []).append({"vhost": name, "error": repr(exc)})
                continue
            if method is not None:
                topo.apply(method)
        for key, rows in (
            ("exchanges", topo.exchanges.values()),
            ("queues", topo.queues.values()),
            ("bindings", topo.bindings),
        ):
            doc[key] += [{**_jsonable(r), "vhost": name} for r in rows]
        policies = _json(vdir / "policies.json") or {}
        doc["policies"] += [{**p, "vhost": name} for p in policies.get("policies", [])]
        for p in policies.get("operator_policies", []):
            doc["parameters"].append(
                {
                    "vhost": name,
                    "component": "operator_policy",
                    "name": p["name"],
                    "value": {k: p[k] for k in ("pattern", "definition", "priority", "apply-to") if k in p},
                }
            )
        limits = (_json(vdir / "limits.json") or {}).get("limits") or {}
        if limits:
            doc["parameters"].append(
                {
                    "vhost": name,
                    "component": "vhost-limits",
                    "name": "limits",
                    "value": dict(sorted(limits.items())),
                }
            )
    for key in ("queues", "exchanges"):
        doc[key].sort(key=lambda e: (e["vhost"], e["name"]))
    return doc
