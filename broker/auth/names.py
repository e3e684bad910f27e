"""Names of users, vhosts and the resources in them: what makes one acceptable.

Every such name travels in an AMQP short string (user and vhost in the
connection handshake, queue and exchange names in their methods), so it is at
most ``MAX_NAME_BYTES`` bytes of UTF-8 and must not be empty. Queue and
exchange names are otherwise free, as in RabbitMQ (its AMQP and HTTP
interfaces take ``<``, quotes, ``/``, ``%``, emoji, control characters and NUL
alike; only the ``amq.`` prefix is reserved, which the model refuses on
declare with 403). Users, vhosts and the other names (policies, ...) carry no
control characters. The user and vhost stores, the management API, LMQ and
definitions import check names here, so all refuse the same ones; every such
name is stored by its SHA-1 or inside a file, never as a file name.
"""

from __future__ import annotations

MAX_NAME_BYTES = 255  # an AMQP short string
FREE_KINDS = frozenset({"queue", "exchange"})  # names as free as RabbitMQ makes them


def name_problem(kind: str, name: str) -> str | None:
    """Why ``name`` cannot name a ``kind`` ("user", "vhost", "queue", ...), or None."""
    if not name:
        return f"{kind} name must not be empty"
    if len(name.encode("utf-8")) > MAX_NAME_BYTES:
        return f"{kind} name is longer than {MAX_NAME_BYTES} bytes"
    if kind not in FREE_KINDS and any(ord(ch) < 32 or ord(ch) == 127 for ch in name):
        return f"{kind} name contains control characters"
    return None


def check_name(kind: str, name: str) -> None:
    """Raise ValueError with ``name_problem``'s text when ``name`` is not acceptable."""
    problem = name_problem(kind, name)
    if problem is not None:
        raise ValueError(problem)
