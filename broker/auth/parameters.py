"""Runtime parameters: global ones (RabbitMQ's ``/api/global-parameters``) in
``global_parameters.json``, and per-vhost ones of registered components (``VhostParameters``).

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
        data = read_json(path, {})
        if not isinstance(data, dict) or not isinstance(data.get("parameters", {}), dict):
            raise StoreError(f"{path}: malformed global parameters file")
        self._values: dict[str, Any] = dict(data.get("parameters", {}))

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


# ------------------------------------------------------------- vhost-scoped parameters
VHOST_FILE_NAME = "parameters.json"

Validator = Callable[[Any], Any]


class VhostParameters:
    """RabbitMQ's per-vhost runtime parameters (``/api/parameters/{component}/{vhost}/{name}``),
    in ``parameters.json``.

    A component exists only once a plugin registered it (``register``: its name and a validator
    that returns the value to keep or raises ValueError naming what is wrong), as in RabbitMQ,
    where a PUT to a component no plugin provides is refused. The file is written whole, file
    first and memory second (as ``GlobalParameters``), so a failed write changes nothing and a
    follower that takes over holds the same table; whoever runs the components hears of every
    change through ``listeners`` and reads the table again.
    """

    def __init__(self, path: Path, sink: ReplicationSink) -> None:
        self._path = path
        self._sink = sink
        self._validators: dict[str, Validator] = {}
        self.listeners: list[Callable[[], None]] = []
        data = read_json(path, {})
        entries = data.get("parameters", []) if isinstance(data, dict) else None
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise StoreError(f"{path}: malformed parameters file")
        try:
            self._values: dict[tuple[str, str, str], Any] = {
                (str(e["component"]), str(e["vhost"]), str(e["name"])): e["value"] for e in entries}
        except KeyError as exc:
            raise StoreError(f"{path}: malformed parameters file (no {exc})") from None

    def register(self, component: str, validate: Validator) -> None:
        self._validators[component] = validate

    def known(self, component: str) -> bool:
        return component in self._validators

    def list(self, component: str | None = None, vhost: str | None = None) -> list[dict[str, Any]]:
        return [{"name": n, "vhost": v, "component": c, "value": value}
                for (c, v, n), value in sorted(self._values.items())
                if (component is None or c == component) and (vhost is None or v == vhost)]

    def get(self, component: str, vhost: str, name: str) -> Any:
        """The value, or None when there is no such parameter."""
        return self._values.get((component, vhost, name))

    def check(self, component: str, name: str, value: Any) -> Any:
        """The value to keep; ValueError unless ``component`` is registered and takes it."""
        validate = self._validators.get(component)
        if validate is None:
            raise ValueError(f"component '{component}' not found")
        check_name("parameter", name)
        if value is None:
            raise ValueError("a parameter needs a 'value'")
        if len(json.dumps(value)) > MAX_VALUE_BYTES:
            raise ValueError(f"a parameter's value must be under {MAX_VALUE_BYTES} bytes of JSON")
        return validate(value)

    def put(self, component: str, vhost: str, name: str, value: Any) -> bool:
        """Set one parameter (validated); True when it is new."""
        value = self.check(component, name, value)
        key = (component, vhost, name)
        new = key not in self._values
        self._commit({**self._values, key: value})
        return new

    def delete(self, component: str, vhost: str, name: str) -> bool:
        key = (component, vhost, name)
        if key not in self._values:
            return False
        self._commit({k: v for k, v in self._values.items() if k != key})
        return True

    def clear_vhost(self, vhost: str) -> None:
        """Forget every parameter of a deleted vhost."""
        if any(v == vhost for _, v, _ in self._values):
            self._commit({k: value for k, value in self._values.items() if k[1] != vhost})

    def _commit(self, values: dict[tuple[str, str, str], Any]) -> None:
        write_json(self._path, {"version": 1, "parameters": [
            {"component": c, "vhost": v, "name": n, "value": value}
            for (c, v, n), value in sorted(values.items())]}, self._sink)
        self._values = values
        for listener in list(self.listeners):
            listener()
