"""Deliberate differences from RabbitMQ 3.10, each with its reason (docs/compatibility.md lists them).

Two kinds:

- ``FIELDS``: a field of one method that differs by design wherever it appears (e.g. a configured
  default proposed in every ``connection.tune``). Both transcripts have the value replaced by
  ``<allowlisted>`` before the diff; nothing else in the scenario is hidden.
- ``SCENARIOS``: a scenario whose transcript differs by design. It must still differ: an entry
  whose scenario has come to agree with RabbitMQ fails, so the list never outlives the difference.

- ``MODE_SCENARIOS``: like ``SCENARIOS``, for one Skred mode of ``_cluster_modes.MODES`` only
  (a scenario that differs where the Skred side is a cluster node, by the cluster's design).
- ``HEADERS``: message headers the broker adds that differ by design; dropped from both sides.
- ``HTTP_KEYS``: keys of RabbitMQ's management API answers that Skred does not send (regular
  expressions over ``key`` or ``parent.key``). Status codes are never allowlisted this way.

A difference that is in none of them fails the harness.
"""

from __future__ import annotations

FIELDS: dict[tuple[str, str], str] = {}

HEADERS: dict[str, str] = {
    key: "dead-lettering adds x-last-death-{exchange,queue,reason} as RabbitMQ 3.13+ and 4.x do "
         "(3.10 has only x-first-death-*)"
    for key in ("x-last-death-exchange", "x-last-death-queue", "x-last-death-reason")
}

SCENARIOS: dict[str, str] = {
    "amqp.conn_heartbeat_on_channel":
        "the spec: a heartbeat on a non-zero channel is 501 FRAME_ERROR (RabbitMQ: 505)",
    "amqp.conn_unknown_method":
        "an unknown method: Skred closes with 540 NOT_IMPLEMENTED naming it; RabbitMQ drops the "
        "socket",
    "amqp.conn_unknown_class":
        "an unknown class: 540 NOT_IMPLEMENTED naming it; RabbitMQ drops the socket",
    "amqp.channel_flow":
        "channel.flow(active=false) is implemented (deliveries pause, flow-ok); RabbitMQ answers "
        "540 NOT_IMPLEMENTED",
}

_ERLANG = "Erlang VM and RabbitMQ-internal detail with no Skred equivalent"
_NOT_SAMPLED = ("not kept by Skred yet: the counter or its rate; the management UI shows such a "
                "field as absent (docs/compatibility.md)")
MODE_SCENARIOS: dict[tuple[str, str], str] = {
    ("http.health_checks", "follower"):
        "a follower forwards its management API to the leader, which checks its own listeners: the "
        "port-listener check of the follower's AMQP port answers 503 in the test, where every node "
        "has a port of its own (in a deployment all nodes use one port, and it answers 200)",
}

HTTP_KEYS: dict[str, str] = {
    r"garbage_collection(\..*)?": _ERLANG,
    r"reductions(_details)?(\..*)?": _ERLANG,
    r"backing_queue_status(\..*)?": _ERLANG,
    r"metrics_gc_queue_length(\..*)?": _ERLANG,
    r"ra_open_file_metrics(\..*)?": _ERLANG,
    r"(mnesia|msg_store|queue_index|io|gc)_[a-z_]+(_details)?(\.rate)?": _ERLANG,
    r"context_switches(_details)?(\.rate)?": _ERLANG,
    r"(net_ticktime|mem_calculation_strategy|contexts|config_files|log_files|db_dir|"
    r"enabled_plugins|cluster_links|auth_mechanisms|exchange_types|recoverable_slaves|memory)": _ERLANG,
    r"(messages|message_bytes)_(ram|paged_out|persistent)|messages_(ready|unacknowledged)_ram|"
    r"message_bytes(_ready|_unacknowledged)?": _ERLANG + " (how a classic queue pages messages)",
    r"sample_retention_policies(\..*)?|release_series_support_status":
        "management-plugin configuration with no Skred equivalent",
    r"message_stats\.(disk_reads|disk_writes)(_details)?": _NOT_SAMPLED + " (message store I/O)",
    r"message_stats\.deliver_no_ack(_details)?":
        _NOT_SAMPLED + " (per queue and vhost: kept only for the node, in the overview)",
    r"incoming|outgoing|deliveries":
        "per channel/exchange/queue pair statistics (RabbitMQ's detailed stats): not kept",
    r"single_active_consumer_tag|head_message_timestamp|idle_since": _NOT_SAMPLED,
    r"send_pend": "bytes waiting in the socket's send buffer: not reported by the event loop's "
                  "transport per connection",
    r"ssl_hash|ssl_key_exchange": "TLS details Python's ssl module does not report separately "
                                  "(ssl_cipher and ssl_protocol are there)",
}

# MQTT (test_mqtt_conformance.py): (scenario, MQTT protocol level 4 or 5, reference broker) -> why
# Skred shows a client something else there. docs/compatibility.md's MQTT section names each.
_QOS2_GRANT = "a QoS 2 subscription is granted QoS 1, as RabbitMQ does; mosquitto grants QoS 2"
_QOS0_KEPT = ("QoS 0 messages for an offline persistent session wait in its queue, as RabbitMQ does; "
              "mosquitto drops them (its queue_qos0_messages is off by default)")
MQTT: dict[tuple[str, int, str], str] = {
    ("connect_refusals", 4, "mosquitto"):
        "a wrong password or an unknown user gets return code 4 (bad user name or password), as from "
        "RabbitMQ; mosquitto answers 5 (not authorized)",
    ("connect_refusals", 5, "mosquitto"):
        "a wrong password, an unknown user and a missing user name get 0x86 (bad user name or "
        "password); mosquitto answers 0x87 (not authorized)",
    ("connect_refusals", 4, "rabbitmq"):
        "no side door: a CONNECT without a user name is refused with 5 (RabbitMQ 3.10 logs it in as "
        "its default user, mqtt.allow_anonymous); an unknown vhost in 'vhost:user' gets 5 (RabbitMQ: 4)",
    ("connect_unknown_protocol_level", 4, "rabbitmq"):
        "an unsupported protocol level gets CONNACK 1 before the close (3.1.2.2), as from mosquitto; "
        "RabbitMQ 3.10 closes without a CONNACK",
    ("keepalive_closes_a_silent_client", 5, "mosquitto"):
        "a client silent for 1.5 x its keepalive gets DISCONNECT 0x8D (keep alive timeout) before the "
        "close; mosquitto closes it without one",
    ("persistent_session_keeps_messages", 4, "mosquitto"): _QOS0_KEPT,
    ("persistent_session_keeps_messages", 5, "mosquitto"): _QOS0_KEPT,
    ("publish_wildcard_topic", 4, "rabbitmq"):
        "a PUBLISH to a topic name with a wildcard is malformed and closes the connection (3.3.2.1), "
        "as on mosquitto; RabbitMQ 3.10 accepts and acknowledges it",
    ("publish_wildcard_topic", 5, "mosquitto"):
        "the DISCONNECT before the close says 0x90 (topic name invalid); mosquitto says 0x82 "
        "(protocol error)",
    ("qos_flows", 4, "mosquitto"): _QOS2_GRANT,
    ("qos_flows", 5, "mosquitto"): _QOS2_GRANT,
    ("qos_flows", 4, "rabbitmq"):
        "a QoS 2 publish gets PUBREC, PUBREL, PUBCOMP (stored once per packet identifier), as on "
        "mosquitto; RabbitMQ 3.10 answers it with PUBACK as if it were QoS 1",
    ("retained_exact_wildcard_and_clear", 4, "rabbitmq"):
        "retained messages reach wildcard subscriptions too (3.3.1.3), as on mosquitto; RabbitMQ 3.10 "
        "sends them to exact-topic subscriptions only",
    ("subscribe_invalid_filter", 4, "rabbitmq"):
        "a filter with '#' before its last level is malformed and closes the connection (4.7.1.2), as "
        "on mosquitto; RabbitMQ 3.10 grants it",
    ("takeover_closes_the_first", 5, "mosquitto"):
        "the connection taken over gets DISCONNECT 0x8E (session taken over) before the close; "
        "mosquitto closes it without one",
    ("v5_reason_codes", 5, "mosquitto"):
        "PUBREC says 0x10 (no matching subscribers) like PUBACK does; mosquitto's PUBREC says 0",
    ("v5_subscription_identifiers", 5, "mosquitto"):
        "a message matching two subscriptions of one session at one QoS arrives once, with both "
        "identifiers; mosquitto sends a copy per subscription (3.3.4 allows either)",
}


# MQTT over WebSocket (test_mqtt_conformance.py, rabbitmq_web_mqtt): 3.1.1 scenario -> why Skred's
# WebSocket listener shows a client something else than rabbitmq_web_mqtt, beyond the TCP
# differences of ``MQTT`` (which hold over WebSocket too). docs/compatibility.md names each.
WEB_MQTT: dict[str, str] = {
    "connect_empty_client_id_persistent":
        "an empty client id with clean session 0 gets CONNACK 2 (identifier rejected) before the close, "
        "as over TCP; rabbitmq_web_mqtt 3.10 closes the WebSocket without a CONNACK",
    "will_on_abnormal_end_only":
        "DISCONNECT discards the will (3.14.4), as over TCP; rabbitmq_web_mqtt 3.10 publishes the will "
        "of a client that sent DISCONNECT and then closed its WebSocket",
}
