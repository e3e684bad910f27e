"""Whose copy is most complete: the order in which ISR members may campaign.

Theory of operation
-------------------
Every ISR member has every confirmed message, but not the same settlements: a
leader replicates an ack the moment it happens and writes it to its own files
within the ack window, so a leader that crashes may have fewer acks on disk
than its followers (which fsync before they ack). If it led again, bulk sync
would hand its older ack files to everyone and acked messages would come back.

So members are ranked, and a member defers while a live ISR member outranks it:

1. *warm* beats cold: warm means this process has followed in sync or led, so
   its files are everything it was sent (a follower) or wrote (a leader that
   stepped down flushed its stores first);
2. among cold (just started) members, the later *term* wins: the term is the
   create revision of the leader key it last followed or held, recorded in
   ``.cluster_role`` (node-local, never replicated) at each role change;
3. in the same term a follower beats the leader: the leader of a crashed term
   is exactly the one whose acks may have been in memory only.

Members with equal standing race for the key, as before. A cold node that was
the leader also waits for ISR members that are not up yet (a whole cluster
restarting): any of them may have what it lacks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, NamedTuple

from broker.cluster.files import ROLE_FILE


class Standing(NamedTuple):
    warm: bool
    term: int
    follower: bool

    @classmethod
    def of(cls, record: dict[str, Any]) -> Standing:
        """From a member record (missing fields: the lowest standing)."""
        last = record.get("last")
        if not isinstance(last, dict):
            last = {}
        term = last.get("term", 0)
        return cls(bool(record.get("warm")), term if isinstance(term, int) else 0,
                   last.get("role") == "follower")


def load_last_role(data_dir: Path) -> dict[str, Any]:
    """``{"role": ..., "term": ...}`` recorded by the previous run, or ``{}``."""
    try:
        value = json.loads((data_dir / ROLE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def save_last_role(data_dir: Path, role: str, term: int) -> None:
    """Record our role in ``term`` durably (write, fsync, rename)."""
    tmp = data_dir / (ROLE_FILE + ".tmp")
    with open(tmp, "w") as fh:
        fh.write(json.dumps({"role": role, "term": term}))
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, data_dir / ROLE_FILE)
