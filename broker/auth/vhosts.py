"""The list of virtual hosts, persisted in ``vhosts.json``.

Theory of operation
-------------------
Only the names live here; each vhost's exchanges, queues and messages belong to
the model and store layers. Every change rewrites the whole (small) file
through ``broker.store.jsonstore.write_json``, which replaces it atomically and
hands it to the replication sink. With no file (first start) the store holds
the default vhost ``/``. Entries are objects (``{"name": "/"}``) rather than
bare strings so metadata such as a description can be added without a format
change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from broker.auth.names import check_name
from broker.errors import StoreError
from broker.store.jsonstore import read_json, write_json
from broker.store.sink import ReplicationSink

FILE_NAME = "vhosts.json"
FILE_VERSION = 1
DEFAULT_VHOST = "/"


class VHostStore:
    """The vhost names of one node, backed by ``path`` (normally ``<data_dir>/vhosts.json``)."""

    def __init__(self, path: Path, sink: ReplicationSink) -> None:
        self._path = path
        self._sink = sink
        data = read_json(path, None)
        if data is None:
            self._names: set[str] = {DEFAULT_VHOST}
            self._save()
        else:
            self._names = _names_from_json(path, data)

    @property
    def path(self) -> Path:
        return self._path

    def reload(self) -> None:
        """Read the file again (another worker of this node changed it: broker/shards)."""
        data = read_json(self._path, None)
        if data is not None:
            self._names = _names_from_json(self._path, data)

    def exists(self, name: str) -> bool:
        return name in self._names

    def list(self) -> list[str]:
        return sorted(self._names)

    def add(self, name: str) -> None:
        check_name("vhost", name)
        if name in self._names:
            raise ValueError(f"vhost {name!r} already exists")
        self._save(self._names | {name})

    def delete(self, name: str) -> None:
        if name not in self._names:
            raise KeyError(f"no vhost {name!r}")
        self._save(self._names - {name})

    def _save(self, names: set[str] | None = None) -> None:
        """vhosts.json first, then memory: a full disk (DiskFull) changes neither."""
        names = self._names if names is None else names
        document = {"version": FILE_VERSION, "vhosts": [{"name": name} for name in sorted(names)]}
        write_json(self._path, document, self._sink)
        self._names = names


def _names_from_json(path: Path, data: Any) -> set[str]:
    try:
        return {str(entry["name"]) for entry in data["vhosts"]}
    except (KeyError, TypeError) as exc:
        raise StoreError(f"{path}: malformed vhosts file ({type(exc).__name__}: {exc})") from None
