"""Deliberate differences from RabbitMQ 3.10, each with its reason (docs/compatibility.md lists them).

Two kinds:

- ``FIELDS``: a field of one method that differs by design wherever it appears (e.g. a configured
  default proposed in every ``connection.tune``). Both transcripts have the value replaced by
  ``<allowlisted>`` before the diff; nothing else in the scenario is hidden.
- ``SCENARIOS``: a scenario whose transcript differs by design. It must still differ: an entry
  whose scenario has come to agree with RabbitMQ fails, so the list never outlives the difference.

A difference that is in neither fails the harness.
"""

from __future__ import annotations

FIELDS: dict[tuple[str, str], str] = {
    ("Connection.Tune", "heartbeat"):
        "configured default: Skred proposes 300 s (LavinMQ's default, [amqp] heartbeat), RabbitMQ 60 s",
    ("Connection.Tune", "channel_max"):
        "configured default: Skred 2048 (LavinMQ's, [amqp] channel_max), RabbitMQ 2047",
    ("Channel.OpenOk", "channel_id"):
        "a reserved field: Skred sends '0' (what pamqp, its codec, insists on), RabbitMQ ''; "
        "clients ignore it",
}

SCENARIOS: dict[str, str] = {}
