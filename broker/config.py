"""Skred configuration: every option declared once, read from four sources.

Theory of operation
-------------------
Each option is a field of one of the frozen section dataclasses below
(``MainConfig``, ``AmqpConfig``, ``MgmtConfig``, ``ClusteringConfig``). The field
carries its default and, in its metadata, its help text, its value kind (``size``
for byte counts that accept suffixes, ``fraction`` for a number from 0 to 1,
``networks`` for CIDR lists) and its
allowed range or choices. ``OPTIONS`` is derived from those fields, and from
``OPTIONS`` are derived:

* the ini file keys: ``[section] name`` (``skred -c FILE``);
* the environment variables: ``SKRED_<SECTION>_<NAME>``, upper case;
* the command-line flags: ``--name`` for ``[main]``, ``--section-name`` for the
  other sections, ``--section`` for a section's ``enabled`` switch, and
  ``--flag/--no-flag`` pairs for booleans.

``load_config`` layers them: defaults < ini < environment < flags. Every value
from ini, environment or flags goes through the same parser (``Option.parse``),
so a bad value is reported the same way wherever it came from: a
``ConfigError`` naming the option and its source. The command line turns that
into exit code 2 without a traceback.

The result is a frozen ``Config`` handed to the components that need it; there
is no global configuration object.
"""

from __future__ import annotations

import argparse
import configparser
import dataclasses
import ipaddress
import os
import re
import sys
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from broker import __version__

ENV_PREFIX = "SKRED"
KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

# The smallest frame_max a peer may ask for (AMQP 0-9-1 section 4.2.3, frame-min-size).
AMQP_FRAME_MIN_SIZE = 4096
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMATS = ("text", "json")


class ConfigError(ValueError):
    """A configuration value or file is unusable; the message names option and source."""


def _meta(
    help: str,
    *,
    kind: str = "",
    lo: int | None = None,
    hi: int | None = None,
    choices: tuple[str, ...] = (),
    default_text: str = "",
) -> dict[str, Any]:
    """Field metadata for one option (see ``Option`` for the meaning of each key)."""
    return {
        "help": help,
        "kind": kind,
        "lo": lo,
        "hi": hi,
        "choices": choices,
        "default_text": default_text,
    }


def file_mode(text: str) -> int:
    """An octal file mode such as ``[main] unix_mode``; ValueError when it is not one."""
    mode = int(text, 8)
    if not 0 <= mode <= 0o777:
        raise ValueError(f"{text!r} is not a file mode")
    return mode


def default_data_dir() -> Path:
    """``/var/lib/skred`` when running as root, else ``~/.local/share/skred``."""
    geteuid = getattr(os, "geteuid", None)  # absent on Windows
    if geteuid is not None and geteuid() == 0:
        return Path("/var/lib/skred")
    return Path.home() / ".local" / "share" / "skred"


@dataclass(frozen=True)
class MainConfig:
    data_dir: Path = field(
        metadata=_meta(
            "Directory holding messages, definitions, users and vhosts.",
            default_text="/var/lib/skred as root, else ~/.local/share/skred",
        )
    )
    segment_size: int = field(
        default=8 * MiB,
        metadata=_meta(
            "Size of a message store segment file, in bytes (suffixes KiB/MiB/GiB allowed).",
            kind="size",
            lo=4 * KiB,
            hi=2 * GiB,
        ),
    )
    workers: int = field(
        default=0,
        metadata=_meta(
            "Worker processes of this node, each the broker of the vhosts the shard map gives it "
            "(rendezvous hashing; any worker accepts a connection and hands it to the owner): 0 one "
            "per CPU core, 1 a single process as before. A cluster member runs one (per-shard "
            "leadership is not built yet). See docs/architecture.md, Workers.",
            lo=0,
            hi=256,
        ),
    )
    sync: bool = field(
        default=True,
        metadata=_meta("fsync the store before confirming a publish (off: faster, less durable)."),
    )
    ack_sync_interval: int = field(
        default=1000,
        metadata=_meta(
            "Milliseconds within which acks, rejects, nacks, purges and the delivered mark "
            "(redelivered flags) reach the disk (fsynced); 0: synchronously, before the next frame "
            "is read, fsynced by a group commit at once.",
            lo=0,
            hi=60_000,
        ),
    )
    node_name: str = field(
        default="",
        metadata=_meta(
            "This node's name, RabbitMQ style name@host, in the management API and metric labels "
            "(without '@': the host name is appended; empty: skred@HOST, or skred-PORT@HOST when "
            "the AMQP port is not 5672, so nodes on one host differ)."
        ),
    )
    log_level: str = field(
        default="info", metadata=_meta("Log level (SIGHUP re-reads it).", choices=LOG_LEVELS)
    )
    log_format: str = field(
        default="text",
        metadata=_meta("Log line format: text, or json (one JSON object per line).", choices=LOG_FORMATS),
    )
    log_file: str = field(
        default="", metadata=_meta("File to append log lines to (empty: standard error).")
    )
    log_exchange: bool = field(
        default=False,
        metadata=_meta("Publish log lines to the topic exchange amq.rabbitmq.log in the default vhost "
                       "(routing key: the level; RabbitMQ's log exchange)."),
    )
    max_message_size: int = field(
        default=128 * MiB,
        metadata=_meta(
            "Largest message body accepted, in bytes (suffixes allowed).", kind="size", lo=1, hi=2 * GiB
        ),
    )
    default_user: str = field(
        default="guest", metadata=_meta("User created on first start (data dir without users.json).")
    )
    default_password: str = field(default="guest", metadata=_meta("Password of the default user."))
    load_definitions: str = field(
        default="",
        metadata=_meta("RabbitMQ definitions JSON file imported at boot (empty: none)."),
    )
    consumer_timeout: int = field(
        default=1_800_000,
        metadata=_meta(
            "Milliseconds a delivery may stay unacknowledged before its channel is closed with 406 "
            "(RabbitMQ's default, 30 minutes; 0: off). x-consumer-timeout overrides it per consumer/queue.",
            lo=0,
        ),
    )
    free_disk_min: int = field(
        default=50 * MiB,
        metadata=_meta(
            "Free disk space under the data dir below which publishers are blocked "
            "(connection.blocked), in bytes (suffixes allowed; RabbitMQ's default is 50 MB; 0: off).",
            kind="size",
            lo=0,
        ),
    )
    vm_memory_high_watermark: float = field(
        default=0.4,
        metadata=_meta(
            "Memory high watermark as a fraction of total memory (the smaller of RAM and the "
            "cgroup limit): above it publishers are blocked (connection.blocked) until memory falls "
            "below it again, RabbitMQ's vm_memory_high_watermark (0: off).",
            kind="fraction",
            lo=0,
            hi=1,
        ),
    )
    vm_memory_high_watermark_absolute: int = field(
        default=0,
        metadata=_meta(
            "Memory high watermark in bytes (suffixes allowed); when set it replaces "
            "vm_memory_high_watermark (0: use the fraction).",
            kind="size",
            lo=0,
        ),
    )
    # Failed-login throttling per source address (AMQP, management HTTP, LMQ). See docs/tls.md.
    login_throttle_free: int = field(
        default=5,
        metadata=_meta("Failed logins a source address may make before its attempts are slowed down.",
                       lo=0, hi=1_000_000),
    )
    login_throttle_delay: int = field(
        default=50,
        metadata=_meta("Milliseconds between checks of a throttled address's logins at first; doubles "
                       "with each further failure up to login_throttle_max_delay.", lo=1, hi=600_000),
    )
    login_throttle_max_delay: int = field(
        default=2000,
        metadata=_meta("Longest interval, in milliseconds, between checks of a throttled address's "
                       "logins.", lo=1, hi=600_000),
    )
    login_throttle_max_wait: int = field(
        default=8000,
        metadata=_meta("Milliseconds a login may wait for its turn; beyond that it is refused unchecked "
                       "(keep it below the clients' handshake timeouts).", lo=0, hi=600_000),
    )
    login_throttle_forget: int = field(
        default=60,
        metadata=_meta("Seconds after its last attempt that an address's failed logins are forgotten.",
                       lo=1, hi=86_400),
    )
    # TLS (AMQPS, HTTPS, the replication link); the names are LavinMQ's. See docs/tls.md.
    unix_mode: str = field(
        default="0660",
        metadata=_meta("File mode (octal) of the Unix sockets ([amqp], [mqtt], [mgmt] unix_path): who may "
                       "connect is who may open the file; the protocols still authenticate."),
    )
    tls_cert: str = field(
        default="",
        metadata=_meta("PEM certificate (chain) of this node; setting it opens the TLS listeners "
                       "([amqp] tls_port, [mgmt] tls_port) and encrypts the replication link."),
    )
    tls_key: str = field(default="", metadata=_meta("PEM private key of tls_cert (empty: in tls_cert)."))
    tls_ca_cert: str = field(
        default="",
        metadata=_meta("PEM CA bundle that client certificates (tls_verify_peer) and cluster peers "
                       "are verified against (empty: the system's)."),
    )
    tls_min_version: str = field(
        default="1.2", metadata=_meta("Oldest TLS version accepted.", choices=("1.2", "1.3"))
    )
    tls_ciphers: str = field(
        default="",
        metadata=_meta("OpenSSL cipher list for TLS 1.2 (empty: OpenSSL's defaults; TLS 1.3 suites "
                       "are OpenSSL's)."),
    )
    tls_verify_peer: bool = field(
        default=False,
        metadata=_meta("Ask TLS clients for a certificate and verify it against tls_ca_cert "
                       "(RabbitMQ's verify_peer); a verified certificate allows EXTERNAL login."),
    )
    tls_fail_if_no_peer_cert: bool = field(
        default=False,
        metadata=_meta("With tls_verify_peer: refuse TLS clients that present no certificate."),
    )
    tls_cert_login_from: str = field(
        default="common_name",
        metadata=_meta("Where the EXTERNAL mechanism takes the user name from in the client "
                       "certificate: its CN, its first DNS/email SAN, or its whole subject DN.",
                       choices=("common_name", "subject_alternative_name", "distinguished_name")),
    )
    tls_sni: str = field(
        default="",
        metadata=_meta("More certificates chosen by the client's server name (SNI): comma-separated "
                       "NAME=CERT_FILE:KEY_FILE (NAME may start with '*.'); other names get tls_cert."),
    )
    auth_backends: str = field(
        default="internal",
        metadata=_meta("Comma-separated authentication backends, tried in order on every login: "
                       "internal (users.json; 'local' is the same), oauth (JWT access tokens, see "
                       "[oauth] and docs/oauth.md)."),
    )


@dataclass(frozen=True)
class AmqpConfig:
    bind: str = field(default="127.0.0.1", metadata=_meta("Address the AMQP listener binds to."))
    unix_path: str = field(
        default="", metadata=_meta("Also serve AMQP on this Unix socket ('': none; see [main] unix_mode).")
    )
    port: int = field(
        default=5672,
        metadata=_meta("AMQP port (0: pick a free port, -1: no plain listener).", lo=-1, hi=65535),
    )
    tls_port: int = field(
        default=5671,
        metadata=_meta("AMQPS port, opened when [main] tls_cert is set (0: pick a free port, -1: off).",
                       lo=-1, hi=65535),
    )
    heartbeat: int = field(
        default=60,  # RabbitMQ's default, so clients see the same timeout on either broker
        metadata=_meta("Heartbeat interval proposed to clients, seconds (0: off).", lo=0, hi=65535),
    )
    frame_max: int = field(
        default=131072,
        metadata=_meta(
            "Largest frame proposed to clients, bytes.", kind="size", lo=AMQP_FRAME_MIN_SIZE, hi=2**32 - 1
        ),
    )
    channel_max: int = field(
        default=2047,  # RabbitMQ's default
        metadata=_meta("Most channels open at once per connection (0: no limit).", lo=0, hi=65535),
    )
    tcp_nodelay: bool = field(default=True, metadata=_meta("Set TCP_NODELAY on client sockets."))
    max_bytes_in_flight: int = field(
        default=256 * MiB,
        metadata=_meta(
            "Bytes in flight per connection (suffixes allowed): message bodies it has announced "
            "and not completed, across its channels (a content header past this closes that "
            "channel with 406; keep it at least max_message_size), and replies it has not read "
            "(past this the connection is not read until it reads them).",
            kind="size",
            lo=1,
        ),
    )
    trusted_proxies: tuple[str, ...] = field(
        default=(),
        metadata=_meta(
            "Comma-separated addresses/CIDRs allowed to send a PROXY protocol header.", kind="networks"
        ),
    )


@dataclass(frozen=True)
class MgmtConfig:
    enabled: bool = field(default=True, metadata=_meta("Serve the management HTTP API and /metrics."))
    unix_path: str = field(
        default="", metadata=_meta("Also serve HTTP on this Unix socket ('': none; see [main] unix_mode).")
    )
    bind: str = field(default="127.0.0.1", metadata=_meta("Address the management listener binds to."))
    port: int = field(
        default=15672,
        metadata=_meta("Management HTTP port (0: pick a free port, -1: no plain listener).", lo=-1, hi=65535),
    )
    tls_port: int = field(
        default=15671,
        metadata=_meta("Management HTTPS port, opened when [main] tls_cert is set (0: pick a free port, "
                       "-1: off).", lo=-1, hi=65535),
    )
    trusted_proxies: tuple[str, ...] = field(
        default=(),
        metadata=_meta(
            "Comma-separated addresses/CIDRs allowed to send a PROXY protocol header to the "
            "management listeners.", kind="networks"
        ),
    )
    metrics_port: int = field(
        default=15692,
        metadata=_meta("Prometheus /metrics port, no auth (0: pick a free port).", lo=0, hi=65535),
    )
    metrics_bind: str = field(
        default="127.0.0.1", metadata=_meta("Address the Prometheus /metrics listener binds to.")
    )
    records_memory: int = field(
        default=256 * MiB,
        metadata=_meta("Bytes of raw stream record answers (GET /api/streams/{vhost}/{queue}/records) a "
                       "process holds at once; a request finding too little waits records_wait seconds, "
                       "then gets 503 with Retry-After (suffixes KiB/MiB/GiB allowed).",
                       kind="size", lo=64 * KiB),
    )
    records_wait: int = field(
        default=10,
        metadata=_meta("Seconds a records request waits for records_memory before its 503 (0: none).",
                       lo=0, hi=3600),
    )
    records_send_timeout: int = field(
        default=60,
        metadata=_meta("Seconds a records answer may take to be sent; a client reading slower is cut off "
                       "(its memory and segment freed).", lo=1, hi=86400),
    )


@dataclass(frozen=True)
class ClusteringConfig:
    enabled: bool = field(default=False, metadata=_meta("Run as a cluster member (needs etcd)."))
    etcd_endpoints: str = field(
        default="127.0.0.1:2379", metadata=_meta("Comma-separated etcd endpoints, host:port.")
    )
    etcd_prefix: str = field(default="skred", metadata=_meta("Key prefix of this cluster in etcd."))
    bind: str = field(default="127.0.0.1", metadata=_meta("Address the replication listener binds to."))
    port: int = field(default=5679, metadata=_meta("Replication port.", lo=0, hi=65535))
    advertised_uri: str = field(
        default="", metadata=_meta("URI followers use to reach this node when it leads (empty: derived).")
    )
    on_leader_elected: str = field(
        default="", metadata=_meta("Shell command run when this node becomes leader.")
    )
    on_leader_lost: str = field(default="", metadata=_meta("Shell command run when this node stops leading."))
    lease_ttl: int = field(default=10, metadata=_meta("etcd lease TTL, seconds.", lo=1, hi=3600))
    max_unsynced_actions: int = field(
        default=8192,
        metadata=_meta("Deprecated, accepted but has no effect (as in LavinMQ): a follower leaves the "
                       "in-sync set when it stops acking replicated data for 3 s.", lo=0),
    )
    tls: bool = field(
        default=True,
        metadata=_meta("Encrypt the replication link with [main] tls_cert/tls_ca_cert when tls_cert is "
                       "set (the leader verified against tls_ca_cert; the cluster secret never in clear)."),
    )
    tunnel_keepalive: int = field(
        default=6,
        metadata=_meta("Seconds of silence after which a client tunnel between a follower's proxy and the "
                       "leader is presumed dead and closed at both ends (pings every third of it).",
                       lo=3, hi=3600),
    )
    disk_stall_timeout: int = field(
        default=20,
        metadata=_meta("A leader whose fsync has not returned for this many seconds gives up its lease.",
                       lo=1, hi=3600),
    )
    shard_leaders: bool = field(
        default=False,
        metadata=_meta("Elect a leader per shard (vhost) in etcd, placed over the nodes by weighted "
                       "rendezvous hashing (broker/shards/leaders.py); off: one leader for everything. "
                       "Clients are still served by the cluster leader this release (docs/architecture.md)."),
    )
    shard_servers: bool = field(
        default=False,
        metadata=_meta("With shard_leaders: a node leading a shard serves it and replicates it itself "
                       "(the hand-over, broker/cluster/handover.py; experimental: every client port of every "
                       "node reaches it, but the management API's overview, metrics and paged lists are "
                       "the cluster leader's part only: docs/architecture.md); off: the cluster leader "
                       "serves every shard."),
    )


@dataclass(frozen=True)
class LmqConfig:
    enabled: bool = field(default=True, metadata=_meta("Serve LMQ's HTTP queue API and MessagePack-RPC."))
    bind: str = field(default="127.0.0.1", metadata=_meta("Address the LMQ listeners bind to."))
    http_port: int = field(
        default=9980, metadata=_meta("LMQ HTTP API port (0: pick a free port).", lo=0, hi=65535)
    )
    rpc_port: int = field(
        default=18800, metadata=_meta("LMQ MessagePack-RPC port (0: pick a free port).", lo=0, hi=65535)
    )
    vhost: str = field(default="/", metadata=_meta("Virtual host whose queues LMQ serves."))
    auth: bool = field(
        default=True,
        metadata=_meta("Require a broker user (HTTP basic auth; RPC authenticate call) and check its "
                       "configure/write/read permissions on every request, as AMQP does; off: LMQ's "
                       "anonymous mode, requests act as anonymous_user."),
    )
    anonymous_user: str = field(
        default="guest",
        metadata=_meta("With auth off, the user every request without credentials acts as: its "
                       "permissions (and loopback_users) apply (empty: refuse such requests)."),
    )
    statsd_host: str = field(default="localhost", metadata=_meta("StatsD host for LMQ statistics."))
    statsd_port: int = field(default=8125, metadata=_meta("StatsD UDP port.", lo=1, hi=65535))
    stats_interval: int = field(
        default=0,
        metadata=_meta("Milliseconds between LMQ statistics sent to StatsD, as LMQ's; '10s' reads as "
                       "seconds (0: off).", kind="millis", lo=0, hi=86_400_000),
    )
    request_timeout: int = field(
        default=30,
        metadata=_meta("Seconds an LMQ HTTP request may take to arrive (headers and body) and an idle "
                       "keep-alive or RPC connection may stay silent before it is closed.", lo=1,
                       hi=86400),
    )
    max_pipelined: int = field(
        default=128,
        metadata=_meta("MessagePack-RPC requests one connection may have in progress; past it the "
                       "connection is not read until answers go out.", lo=1, hi=65536),
    )


@dataclass(frozen=True)
class MqttConfig:
    enabled: bool = field(default=True, metadata=_meta("Serve MQTT 3.1, 3.1.1 and 5.0 (broker/mqtt)."))
    unix_path: str = field(
        default="", metadata=_meta("Also serve MQTT on this Unix socket ('': none; see [main] unix_mode).")
    )
    bind: str = field(default="127.0.0.1", metadata=_meta("Address the MQTT listeners bind to."))
    port: int = field(
        default=1883,
        metadata=_meta("MQTT port (0: pick a free port, -1: no plain listener).", lo=-1, hi=65535),
    )
    tls_port: int = field(
        default=8883,
        metadata=_meta("MQTTS port, opened when [main] tls_cert is set (0: pick a free port, -1: off).",
                       lo=-1, hi=65535),
    )
    vhost: str = field(default="/", metadata=_meta("Vhost of a user name without 'vhost:'."))
    exchange: str = field(
        default="amq.topic", metadata=_meta("Topic exchange MQTT publishes to and subscriptions bind to.")
    )
    prefetch: int = field(
        default=10,
        metadata=_meta("QoS 1 deliveries in flight per connection, unacknowledged.", lo=1, hi=65535),
    )
    max_packet_size: int = field(
        default=0,
        metadata=_meta("Largest MQTT packet accepted, bytes (0: [main] max_message_size plus 64 KiB for the "
                       "topic and header).", kind="size", lo=0, hi=268_435_460),
    )
    connect_timeout: int = field(
        default=10, metadata=_meta("Seconds a new connection has to send CONNECT.", lo=1, hi=3600)
    )
    max_retained: int = field(
        default=100_000, metadata=_meta("Retained messages the node keeps, over all vhosts.", lo=0)
    )
    max_subscriptions: int = field(
        default=1_000,  # each costs a binding on the MQTT exchange: about 3 KiB and a compiled pattern
        metadata=_meta("Topic filters one session may subscribe to; more are refused (SUBACK 0x80, "
                       "MQTT 5: 0x97 quota exceeded).", lo=1),
    )


@dataclass(frozen=True)
class OAuthConfig:
    """OAuth 2 / OpenID Connect access tokens (``broker/auth/oauth.py``; docs/oauth.md)."""

    issuer: str = field(default="", metadata=_meta(
        "Issuer URL of the OpenID Connect provider: tokens' iss must equal it, and its keys are found "
        "at <issuer>/.well-known/openid-configuration."))
    jwks_uri: str = field(default="", metadata=_meta("JWKS URL (empty: from the issuer's discovery)."))
    resource_server_id: str = field(default="", metadata=_meta(
        "This broker's id at the provider: the default audience and scope prefix ('<id>.')."))
    audience: str = field(default="", metadata=_meta(
        "Comma-separated audiences a token's aud must name one of (empty: resource_server_id)."))
    verify_aud: bool = field(default=True, metadata=_meta("Check the token's aud claim."))
    scope_prefix: str = field(default="", metadata=_meta(
        "Prefix of the scopes that grant permissions (empty: '<resource_server_id>.')."))
    additional_scopes_key: str = field(default="", metadata=_meta(
        "A claim with more scopes, besides 'scope' (empty: none)."))
    preferred_username_claims: str = field(default="preferred_username,sub", metadata=_meta(
        "Comma-separated claims the user name is taken from, the first present wins."))
    leeway: int = field(default=5, metadata=_meta(
        "Seconds of clock skew allowed when checking exp and nbf.", lo=0, hi=300))
    jwks_cache_ttl: int = field(default=3600, metadata=_meta(
        "Seconds between fetches of the issuer's keys.", lo=1, hi=86400 * 7))
    jwks_min_refresh: int = field(default=10, metadata=_meta(
        "A token signed with an unknown key fetches the keys again at most this often, seconds.",
        lo=0, hi=3600))
    fetch_timeout: int = field(default=5, metadata=_meta(
        "Seconds a fetch of the discovery document or the keys may take.", lo=1, hi=60))
    client_id: str = field(default="", metadata=_meta(
        "OAuth client id of the management UI's login (empty: no 'Sign in with' button)."))
    ui_scopes: str = field(default="openid profile", metadata=_meta(
        "Space-separated scopes the management UI asks for besides the resource server's."))
    provider_name: str = field(default="", metadata=_meta(
        "Name on the UI's 'Sign in with ...' button (empty: the issuer's host)."))


@dataclass(frozen=True)
class StreamConfig:
    enabled: bool = field(default=True,
                          metadata=_meta("Serve the RabbitMQ Stream protocol (broker/streamproto)."))
    unix_path: str = field(
        default="", metadata=_meta("Also serve the stream protocol on this Unix socket ('': none).")
    )
    bind: str = field(default="127.0.0.1", metadata=_meta("Address the stream protocol listeners bind to."))
    port: int = field(
        default=5552,
        metadata=_meta("Stream protocol port (0: pick a free port, -1: no plain listener).", lo=-1, hi=65535),
    )
    tls_port: int = field(
        default=5551,
        metadata=_meta("Stream protocol TLS port, opened when [main] tls_cert is set (0: pick a free port, "
                       "-1: off).", lo=-1, hi=65535),
    )
    advertised_host: str = field(
        default="", metadata=_meta("Host that Open and Metadata tell clients to connect to ('': the "
                                   "address the client reached; set it behind a load balancer).")
    )
    advertised_port: int = field(
        default=0, metadata=_meta("Port that Open and Metadata name (0: the port the client reached).",
                                  lo=0, hi=65535)
    )
    frame_max: int = field(
        default=1024 * 1024,
        metadata=_meta("Largest frame after the login, bytes (a Publish frame carries its messages).",
                       kind="size", lo=4096, hi=64 * 1024 * 1024),
    )
    heartbeat: int = field(
        default=60, metadata=_meta("Heartbeat interval offered in Tune, seconds (0: none).", lo=0, hi=86400)
    )
    connect_timeout: int = field(
        default=10, metadata=_meta("Seconds a new connection has to authenticate and open a vhost.",
                                   lo=1, hi=3600)
    )


@dataclass(frozen=True)
class Config:
    main: MainConfig
    amqp: AmqpConfig = field(default_factory=AmqpConfig)
    mgmt: MgmtConfig = field(default_factory=MgmtConfig)
    clustering: ClusteringConfig = field(default_factory=ClusteringConfig)
    lmq: LmqConfig = field(default_factory=LmqConfig)
    mqtt: MqttConfig = field(default_factory=MqttConfig)
    oauth: OAuthConfig = field(default_factory=OAuthConfig)
    stream: StreamConfig = field(default_factory=StreamConfig)


SECTIONS: dict[str, type[Any]] = {
    "main": MainConfig,
    "amqp": AmqpConfig,
    "mgmt": MgmtConfig,
    "clustering": ClusteringConfig,
    "lmq": LmqConfig,
    "mqtt": MqttConfig,
    "oauth": OAuthConfig,
    "stream": StreamConfig,
}

_TRUE = frozenset({"true", "yes", "1", "on"})
_FALSE = frozenset({"false", "no", "0", "off"})
_SIZE_RE = re.compile(r"\s*(\d+)\s*([kmg]i?b?|b)?\s*", re.IGNORECASE)
_MILLIS_RE = re.compile(r"\s*(\d+)\s*(ms|s)?\s*", re.IGNORECASE)
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": KiB, "ki": KiB, "kib": KiB, "kb": 1000,
    "m": MiB, "mi": MiB, "mib": MiB, "mb": 1000**2,
    "g": GiB, "gi": GiB, "gib": GiB, "gb": 1000**3,
}  # fmt: skip


@dataclass(frozen=True)
class Option:
    """One option, derived from a section dataclass field.

    ``kind`` is one of ``str``, ``int``, ``size`` (int accepting unit suffixes), ``millis``
    (int milliseconds; a number with ``s`` is seconds),
    ``fraction`` (float from lo to hi), ``bool``, ``path``, ``networks`` (tuple of
    CIDRs). ``default`` is None only
    for ``data_dir``, whose default depends on the user (``default_data_dir``).
    """

    section: str
    name: str
    kind: str
    default: Any
    help: str
    lo: int | None = None
    hi: int | None = None
    choices: tuple[str, ...] = ()
    default_text: str = ""

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def env(self) -> str:
        return f"{ENV_PREFIX}_{self.section}_{self.name}".upper()

    @property
    def flag(self) -> str:
        if self.section == "main":
            return "--" + self.name.replace("_", "-")
        if self.name == "enabled":
            return "--" + self.section
        return f"--{self.section}-{self.name}".replace("_", "-")

    @property
    def dest(self) -> str:
        return f"{self.section}__{self.name}"

    def describe_default(self) -> str:
        if self.default_text:
            return self.default_text
        if self.kind == "bool":
            return "true" if self.default else "false"
        if self.kind == "networks":
            return ",".join(self.default) or "none"
        if self.kind == "size":
            return _format_size(self.default)
        if self.default == "":
            return "empty"
        return str(self.default)

    def parse(self, text: str) -> Any:
        """Convert one textual value; raises ValueError with a short reason."""
        value: Any
        if self.kind == "bool":
            lowered = text.strip().lower()
            if lowered in _TRUE:
                return True
            if lowered in _FALSE:
                return False
            raise ValueError(f"{text!r} is not a boolean (use true/false, yes/no, on/off, 1/0)")
        if self.kind == "fraction":
            try:
                value = float(text.strip())
            except ValueError:
                raise ValueError(f"{text!r} is not a number") from None
            if not (self.lo or 0) <= value <= (1 if self.hi is None else self.hi):
                raise ValueError(f"{value} is not between {self.lo} and {self.hi}")
            return value
        if self.kind in ("int", "size", "millis"):
            value = {"size": _parse_size, "millis": _parse_millis}.get(self.kind, _parse_int)(text)
            if self.lo is not None and value < self.lo:
                raise ValueError(f"{value} is below the minimum {self.lo}")
            if self.hi is not None and value > self.hi:
                raise ValueError(f"{value} is above the maximum {self.hi}")
            return value
        if self.kind == "path":
            if not text.strip():
                raise ValueError("empty path")
            return Path(text.strip()).expanduser()
        if self.kind == "networks":
            items = tuple(item.strip() for item in text.split(",") if item.strip())
            for item in items:
                try:
                    ipaddress.ip_network(item, strict=False)
                except ValueError:
                    raise ValueError(f"{item!r} is not an IP address or CIDR") from None
            return items
        if self.choices:
            lowered = text.strip().lower()
            if lowered not in self.choices:
                raise ValueError(f"{text!r} is not one of {', '.join(self.choices)}")
            return lowered
        return text


def _parse_int(text: str) -> int:
    try:
        return int(text.strip(), 10)
    except ValueError:
        raise ValueError(f"{text!r} is not an integer") from None


def _parse_size(text: str) -> int:
    match = _SIZE_RE.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not a size (bytes, or a number with KiB/MiB/GiB)")
    return int(match.group(1)) * _SIZE_UNITS[(match.group(2) or "").lower()]


def _parse_millis(text: str) -> int:
    match = _MILLIS_RE.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not a duration (milliseconds, or a number with ms or s)")
    return int(match.group(1)) * (1000 if (match.group(2) or "").lower() == "s" else 1)


def _format_size(value: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if value >= scale and value % scale == 0:
            return f"{value // scale}{unit}"
    return str(value)


def _kind_of(annotation: Any, meta: Mapping[str, Any]) -> str:
    if meta["kind"]:
        return str(meta["kind"])
    for python_type, kind in ((bool, "bool"), (int, "int"), (str, "str"), (Path, "path")):
        if annotation is python_type:
            return kind
    raise TypeError(f"no option kind for {annotation!r}")


def _derive_options() -> tuple[Option, ...]:
    options: list[Option] = []
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = None if f.default is dataclasses.MISSING else f.default
            options.append(
                Option(
                    section=section,
                    name=f.name,
                    kind=_kind_of(hints[f.name], f.metadata),
                    default=default,
                    help=f.metadata["help"],
                    lo=f.metadata["lo"],
                    hi=f.metadata["hi"],
                    choices=f.metadata["choices"],
                    default_text=f.metadata["default_text"],
                )
            )
    return tuple(options)


OPTIONS: tuple[Option, ...] = _derive_options()
_BY_KEY: dict[str, Option] = {option.key: option for option in OPTIONS}

_DESCRIPTION = """\
Skred: a disk-first AMQP 0-9-1 message broker.

Every option can be set, from lowest to highest precedence, by its default, in
the ini file given with -c (sections [main] [amqp] [mgmt] [clustering] [lmq] [mqtt] [stream], keys as
named below), by an environment variable SKRED_<SECTION>_<OPTION>, or by a flag.
Booleans accept true/false, yes/no, on/off, 1/0; sizes accept bytes or a number
with KiB/MiB/GiB."""


class OneLineErrorParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line (``PROG: error: ... (see PROG --help)``)
    and exit 2, instead of the whole usage text first."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The ``skred`` argument parser; every flag defaults to None meaning "not given"."""
    parser = OneLineErrorParser(
        prog="skred", description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"skred {__version__}")
    parser.add_argument("-c", "--config", metavar="FILE", type=Path, help="ini file to read options from")
    parser.add_argument("--cluster-status", action="store_true",
                        help="print the cluster's leader, ISR and members (read from etcd) and exit")
    parser.add_argument("--json", action="store_true", help="with --cluster-status: print JSON")
    groups = {section: parser.add_argument_group(f"[{section}] options") for section in SECTIONS}
    for option in OPTIONS:
        text = (
            f"{option.help} Default: {option.describe_default()}. "
            f"Env: {option.env}; ini: [{option.section}] {option.name}."
        ).replace("%", "%%")  # argparse %-formats help strings
        group = groups[option.section]
        if option.kind == "bool":
            group.add_argument(
                option.flag, dest=option.dest, action=argparse.BooleanOptionalAction, default=None, help=text
            )
        else:
            metavar = "{" + ",".join(option.choices) + "}" if option.choices else option.kind.upper()
            group.add_argument(option.flag, dest=option.dest, default=None, metavar=metavar, help=text)
    return parser


def _read_ini(path: Path) -> dict[str, tuple[str, str]]:
    """``{option key: (raw value, source description)}`` from an ini file."""
    # No interpolation: hook commands may contain '%'.
    ini = configparser.ConfigParser(interpolation=None)
    try:
        with open(path, encoding="utf-8") as fh:
            ini.read_file(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except configparser.Error as exc:
        raise ConfigError(f"config file {path} is not a valid ini file: {exc}") from None
    found: dict[str, tuple[str, str]] = {}
    for section in ini.sections():
        if section not in SECTIONS:
            raise ConfigError(
                f"config file {path}: unknown section [{section}] (known: {', '.join(SECTIONS)})"
            )
        for name, raw in ini.items(section):
            key = f"{section}.{name}"
            if key not in _BY_KEY:
                raise ConfigError(f"config file {path}: unknown option {name!r} in section [{section}]")
            found[key] = (raw, f"[{section}] {name} in {path}")
    return found


# Variables deploy/docker-compose.yml reads from the user's shell (docs/deployment.md has them
# exported there) and hands the broker under their full names: a shell that has them must still
# run ``skred --cluster-status``.
DEPLOY_SHELL_NAMES: Final = frozenset({"SKRED_DEFAULT_USER", "SKRED_DEFAULT_PASSWORD", "SKRED_TLS_CERT",
                                       "SKRED_TLS_KEY", "SKRED_TLS_CA_CERT"})


def check_env_names(env: Mapping[str, str]) -> None:
    """Refuse ``SKRED_<NAME>`` for a ``[main]`` option: its flag is ``--<name>`` but its variable
    ``SKRED_MAIN_<NAME>``, and the short spelling, once ignored, silently left the default in
    force (``SKRED_WORKERS=1`` ran a worker per core). Other ``SKRED_`` names (hooks' variables,
    ``DEPLOY_SHELL_NAMES``) are not the broker's and stay allowed."""
    for option in OPTIONS:
        short = f"{ENV_PREFIX}_{option.name}".upper()
        if option.section == "main" and short in env and short not in DEPLOY_SHELL_NAMES:
            raise ConfigError(f"environment variable {short} is not read: [main] {option.name} is "
                              f"{option.env} (or {option.flag})")


def load_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> Config:
    """Layer defaults < ini < environment < flags into a frozen ``Config``.

    Raises ``ConfigError`` for a bad value or file; argparse itself exits with
    status 2 on unknown flags and with 0 after ``--help``/``--version``.
    """
    args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    env = os.environ if environ is None else environ

    check_env_names(env)
    raw: dict[str, tuple[str, str]] = {}
    if args.config is not None:
        raw.update(_read_ini(args.config))
    for option in OPTIONS:
        if option.env in env:
            raw[option.key] = (env[option.env], f"environment variable {option.env}")

    values: dict[str, Any] = {}
    for key, (text, source) in raw.items():
        option = _BY_KEY[key]
        try:
            values[key] = option.parse(text)
        except ValueError as exc:
            raise ConfigError(f"invalid value for {key} from {source}: {exc}") from None
    for option in OPTIONS:
        given = getattr(args, option.dest)
        if given is None:
            continue
        if option.kind == "bool":
            values[option.key] = bool(given)
            continue
        try:
            values[option.key] = option.parse(given)
        except ValueError as exc:
            raise ConfigError(f"invalid value for {option.key} from flag {option.flag}: {exc}") from None

    sections: dict[str, Any] = {}
    for section, cls in SECTIONS.items():
        kwargs = {
            option.name: values[option.key]
            for option in OPTIONS
            if option.section == section and option.key in values
        }
        if section == "main" and "data_dir" not in kwargs:
            kwargs["data_dir"] = default_data_dir()
        sections[section] = cls(**kwargs)
    return Config(**sections)
