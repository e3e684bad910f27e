"""Global runtime parameters (RabbitMQ's ``/api/global-parameters``), in ``global_parameters.json``.

Theory of operation: a small name -> JSON value table that RabbitMQ keeps cluster-wide
(``cluster_name``, ``internal_cluster_id``, an operator's own settings) and writes into every
definitions export as ``global_parameters``. Skred keeps it so that such an export imports and
exports whole. Like ``users.json`` the file is rewritten whole on each change through
``write_json`` (atomic replace, handed to the replication sink), file first and memory second, so
a failed write changes nothing and a follower that takes over has the same table.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from broker.auth.names import check_name
from broker.errors import StoreError
from broker.store.jsonstore import read_json, write_json
from broker.store.sink import ReplicationSink

FILE_NAME = "global_parameters.json"
MAX_VALUE_BYTES = 64 * 1024  # a parameter is configuration, not data


class GlobalParameters:
    def __init__(self, path: Path, sink: ReplicationSink) -> None:
        self._path = path
        self._sink = sink
        self._values: dict[str, Any] = {}
        self.reload()

    @property
    def path(self) -> Path:
        return self._path

    def reload(self) -> None:
        """Read the file again (another worker of this node changed it: broker/shards)."""
        data = read_json(self._path, {})
        if not isinstance(data, dict) or not isinstance(data.get("parameters", {}), dict):
            raise StoreError(f"{self._path}: malformed global parameters file")
        self._values = dict(data.get("parameters", {}))

    def list(self) -> list[dict[str, Any]]:
        return [{"name": n, "value": self._values[n]} for n in sorted(self._values)]

    def get(self, name: str) -> Any:
        """The value, or None when there is no such parameter."""
        return self._values.get(name)

    def __contains__(self, name: str) -> bool:
        return name in self._values

    @staticmethod
    def check(name: str, value: Any) -> None:
        """ValueError unless ``name`` and ``value`` may be stored."""
        check_name("global parameter", name)
        if value is None:
            raise ValueError("a global parameter needs a 'value'")
        if len(json.dumps(value)) > MAX_VALUE_BYTES:
            raise ValueError(f"a global parameter's value must be under {MAX_VALUE_BYTES} bytes of JSON")

    def put(self, name: str, value: Any) -> bool:
        """Set one parameter; True when it is new."""
        self.check(name, value)
        new = name not in self._values
        self._commit({**self._values, name: value})
        return new

    def delete(self, name: str) -> bool:
        if name not in self._values:
            return False
        self._commit({k: v for k, v in self._values.items() if k != name})
        return True

    def _commit(self, values: dict[str, Any]) -> None:
        write_json(self._path, {"version": 1, "parameters": values}, self._sink)
        self._values = values


RUNTIME_FILE_NAME = "parameters.json"
KEPT_STATE = ("paused",)  # state that outlives a change of the parameter's value
Validate = Callable[[str, str, Any], Any]  # (vhost, name, value) -> the value to keep, or ValueError
Watcher = Callable[[str, str, str, Any], None]  # (component, vhost, name, value or None when deleted)


class RuntimeParameters:
    """RabbitMQ's vhost-scoped runtime parameters (``/api/parameters/{component}/{vhost}/{name}``),
    in ``parameters.json``.

    A feature that is configured through parameters (shovels, federation upstreams) registers its
    component with a validator, and may watch changes to act on them. The table is written whole on
    each change like the global parameters (file first, memory second, through the replication
    sink), so a follower that takes over has every shovel and upstream. Entries of a component that
    nobody registered are kept as they are (they load, list and export) but cannot be set.
    """

    def __init__(self, path: Path, sink: ReplicationSink) -> None:
        self._path = path
        self._sink = sink
        data = read_json(path, {})
        entries = data.get("parameters", []) if isinstance(data, dict) else None
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise StoreError(f"{path}: malformed runtime parameters file")
        self._entries: dict[tuple[str, str, str], dict[str, Any]] = {
            (str(e["component"]), str(e["vhost"]), str(e["name"])): e for e in entries}
        self._components: dict[str, Validate] = {}
        self._watchers: list[Watcher] = []

    def register(self, component: str, validate: Validate) -> None:
        self._components[component] = validate

    def knows(self, component: str) -> bool:
        return component in self._components

    def watch(self, watcher: Watcher) -> None:
        self._watchers.append(watcher)

    def unwatch(self, watcher: Watcher) -> None:
        if watcher in self._watchers:
            self._watchers.remove(watcher)

    def list(self, component: str | None = None, vhost: str | None = None) -> list[dict[str, Any]]:
        """RabbitMQ's JSON shape: ``vhost``, ``component``, ``name``, ``value``, sorted."""
        return [{"vhost": v, "component": c, "name": n, "value": e["value"]}
                for (c, v, n), e in sorted(self._entries.items())
                if component in (None, c) and vhost in (None, v)]

    def get(self, component: str, vhost: str, name: str) -> Any:
        """The value, or None when there is no such parameter."""
        entry = self._entries.get((component, vhost, name))
        return None if entry is None else entry["value"]

    def owner(self, component: str, vhost: str, name: str) -> str | None:
        """The user who set the parameter last (whose permissions a local endpoint uses)."""
        entry = self._entries.get((component, vhost, name))
        return None if entry is None else entry.get("user")

    def state(self, component: str, vhost: str, name: str) -> dict[str, Any]:
        """What the component keeps beside a parameter (a shovel's pause): not part of its value,
        not exported; replicated and kept across restarts with it."""
        entry = self._entries.get((component, vhost, name))
        return dict(entry.get("state", {})) if entry is not None else {}

    def set_state(self, component: str, vhost: str, name: str, **values: Any) -> bool:
        """Update the state kept beside a parameter; False when there is no such parameter."""
        key = (component, vhost, name)
        entry = self._entries.get(key)
        if entry is None:
            return False
        self._commit({**self._entries, key: {**entry, "state": {**entry.get("state", {}), **values}}})
        return True

    def check(self, component: str, vhost: str, name: str, value: Any) -> Any:
        """The value as it would be stored; ValueError naming what is wrong otherwise."""
        validate = self._components.get(component)
        if validate is None:
            raise ValueError(f"component '{component}' not found")
        check_name(f"{component} parameter", name)
        if value is None:
            raise ValueError("a parameter needs a 'value'")
        if len(json.dumps(value)) > MAX_VALUE_BYTES:
            raise ValueError(f"a parameter's value must be under {MAX_VALUE_BYTES} bytes of JSON")
        return validate(vhost, name, value)

    def put(self, component: str, vhost: str, name: str, value: Any, user: str | None = None) -> bool:
        """Validate and set one parameter; True when it is new."""
        value = self.check(component, vhost, name, value)
        key = (component, vhost, name)
        new = key not in self._entries
        entry: dict[str, Any] = {"component": component, "vhost": vhost, "name": name, "value": value}
        if user is not None:
            entry["user"] = user
        kept = {k: v for k, v in self.state(component, vhost, name).items() if k in KEPT_STATE}
        if kept:
            entry["state"] = kept
        self._commit({**self._entries, key: entry})
        self._tell(component, vhost, name, value)
        return new

    def delete(self, component: str, vhost: str, name: str) -> bool:
        key = (component, vhost, name)
        if key not in self._entries:
            return False
        self._commit({k: e for k, e in self._entries.items() if k != key})
        self._tell(component, vhost, name, None)
        return True

    def clear_vhost(self, vhost: str) -> None:
        """A deleted vhost's parameters go with it."""
        for component, v, name in [k for k in self._entries if k[1] == vhost]:
            self.delete(component, v, name)

    def _tell(self, component: str, vhost: str, name: str, value: Any) -> None:
        for watcher in self._watchers:
            watcher(component, vhost, name, value)

    def _commit(self, entries: dict[tuple[str, str, str], dict[str, Any]]) -> None:
        write_json(self._path, {"version": 1, "parameters": [entries[k] for k in sorted(entries)]},
                   self._sink)
        self._entries = entries
