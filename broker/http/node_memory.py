"""A node's memory breakdown in the shape of RabbitMQ's ``GET /api/nodes/{node}/memory``.

RabbitMQ splits the Erlang VM's memory by what holds it (queue processes, binaries, the
management database, code, ...). A Python process cannot attribute its heap per object
cheaply, so Skred reports what the kernel and the broker itself know exactly, under
RabbitMQ's keys where the meaning matches and its own names where it does not:

- ``total``: ``rss`` (resident set), ``allocated`` (anonymous resident memory: what the memory
  watermark counts, ``amqp/memory.py``), ``erlang`` (the same, for tools that read that key);
- ``mgmt_db``: the statistics history (``history.py``), counted from its arrays;
- ``code``: the resident text pages of the executable;
- ``mapped_segments`` (Skred): resident file-backed pages, the message segments mapped in;
- ``other_proc``: the rest of the anonymous memory (queues, connections, messages in flight);
- ``strategy``: ``rss``, as RabbitMQ names this way of measuring.

Read from ``/proc/self/status`` and ``/proc/self/statm``; zeros where they are missing.
"""

from __future__ import annotations

import os
from typing import Any

_KEYS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")


def _status() -> dict[str, int]:
    out = dict.fromkeys(_KEYS, 0)
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in out:
                    out[key] = int(rest.split()[0]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return out


def _text() -> int:
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            return int(fh.read().split()[3]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def breakdown(history_bytes: int) -> dict[str, Any]:
    st = _status()
    anon = st["RssAnon"]
    return {
        "total": {"rss": st["VmRSS"], "allocated": anon, "erlang": anon},
        "mgmt_db": history_bytes,
        "code": _text(),
        "mapped_segments": st["RssFile"] + st["RssShmem"],
        "other_proc": max(0, anon - history_bytes),
        "strategy": "rss",
    }
