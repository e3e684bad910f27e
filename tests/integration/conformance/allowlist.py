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

SCENARIOS: dict[str, str] = {
    "amqp.conn_channel_above_channel_max":
        "the spec's channel-max is the highest channel number: Skred refuses channel 6 of 5 with "
        "504; RabbitMQ counts open channels and opens it",
    "amqp.conn_frame_max_below_minimum":
        "a bad tune-ok: Skred says why (530 NOT_ALLOWED, 'frame_max 1024 below minimum 4096') "
        "before closing; RabbitMQ closes the socket without a word",
    "amqp.conn_frame_max_above_server":
        "a bad tune-ok: Skred answers 530 with the reason; RabbitMQ closes the socket silently",
    "amqp.conn_heartbeat_on_channel":
        "the spec: a heartbeat on a non-zero channel is 501 FRAME_ERROR (RabbitMQ: 505)",
    "amqp.conn_unknown_method":
        "an unknown method: Skred closes with 540 NOT_IMPLEMENTED naming it; RabbitMQ drops the "
        "socket",
    "amqp.conn_unknown_class":
        "an unknown class: 540 NOT_IMPLEMENTED naming it; RabbitMQ drops the socket",
    "amqp.conn_truncated_method":
        "undecodable method arguments: the spec's 502 SYNTAX_ERROR (RabbitMQ: 501 FRAME_ERROR); the "
        "class/method ids agree",
    "amqp.channel_flow":
        "channel.flow(active=false) is implemented (deliveries pause, flow-ok); RabbitMQ answers "
        "540 NOT_IMPLEMENTED",
    "amqp.basic_recover":
        "basic.recover(requeue=false) redelivers to the same channel as the spec says; RabbitMQ "
        "answers 540 NOT_IMPLEMENTED",
}
