"""Names of users, vhosts and the resources in them: what makes one acceptable.

Every such name travels in an AMQP short string (user and vhost in the
connection handshake, queue and exchange names in their methods), so it is at
most ``MAX_NAME_BYTES`` bytes of UTF-8; it must not be empty and carries no
control characters (they would end up in logs and JSON). The user and vhost
stores and the management API check names here, so all refuse the same ones.
"""

from __future__ import annotations

MAX_NAME_BYTES = 255  # an AMQP short string


def name_problem(kind: str, name: str) -> str | None:
    """Why ``name`` cannot name a ``kind`` ("user", "vhost", "queue", ...), or None."""
    if not name:
        return f"{kind} name must not be empty"
    if len(name.encode("utf-8")) > MAX_NAME_BYTES:
        return f"{kind} name is longer than {MAX_NAME_BYTES} bytes"
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in name):
        return f"{kind} name contains control characters"
    return None


def check_name(kind: str, name: str) -> None:
    """Raise ValueError with ``name_problem``'s text when ``name`` is not acceptable."""
    problem = name_problem(kind, name)
    if problem is not None:
        raise ValueError(problem)
