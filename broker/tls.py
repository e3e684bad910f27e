"""TLS contexts built from ``[main] tls_*``: listeners, SNI, reload, peer identity.

Theory of operation
-------------------
``ServerTLS`` owns the server-side ``ssl.SSLContext`` every TLS listener (AMQPS,
HTTPS, the replication port) hands to each connection it accepts: a default
context with ``tls_cert``/``tls_key`` plus one context per ``tls_sni`` name.
The default context's ``sni_callback`` moves a handshake to the context of
the server name the client asked for (an exact name first, then a ``*.``
wildcard one label deep); an unknown or absent name keeps the default.

``reload()`` (SIGHUP) builds every context afresh from the files and swaps
them in only when all of them load, so a typo in a renewed key never leaves
the node without TLS. Listeners read ``ServerTLS.context`` per accepted
connection: new connections get the new certificates, established ones keep
the session they negotiated, nothing is dropped.

Client certificates (``tls_verify_peer``): verified against ``tls_ca_cert``;
with ``tls_fail_if_no_peer_cert`` a client without one fails the handshake.
Python's ``getpeercert()`` only reports a certificate that verified, so
``PeerTLS.login_name`` (the EXTERNAL mechanism's user name, as RabbitMQ's
``rabbitmq_auth_mechanism_ssl`` derives it) can only come from a trusted one.

A verified peer carried from the member that ended its TLS to the one serving the client's vhost
travels as PROXY v2's SSL TLV (``carried`` / ``from_carried``, at the end of this module).

This module is a leaf next to ``config``: it imports ``ssl`` and ``config``
only, so the network, HTTP and cluster layers may all use it.
"""

from __future__ import annotations

import json
import logging
import ssl
import struct
from dataclasses import dataclass
from typing import Any

from broker.config import ConfigError, MainConfig

log = logging.getLogger(__name__)

_VERSIONS = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}
# getpeercert() attribute names -> the short names of RFC 4514 distinguished names
_DN_NAMES = {
    "commonName": "CN", "organizationName": "O", "organizationalUnitName": "OU", "countryName": "C",
    "stateOrProvinceName": "ST", "localityName": "L", "domainComponent": "DC", "userId": "UID",
    "streetAddress": "STREET", "emailAddress": "emailAddress",
}  # fmt: skip


def enabled(main: MainConfig) -> bool:
    return bool(main.tls_cert)


def parse_sni(text: str) -> dict[str, tuple[str, str]]:
    """``NAME=CERT:KEY, ...`` -> {name: (cert, key)}; raises ConfigError naming the bad entry."""
    out: dict[str, tuple[str, str]] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, eq, files = item.partition("=")
        cert, colon, key = files.partition(":")
        if not eq or not name.strip() or not cert.strip():
            raise ConfigError(f"[main] tls_sni: {item!r} is not NAME=CERT_FILE:KEY_FILE")
        out[name.strip().lower()] = (cert.strip(), key.strip() if colon else "")
    return out


def _base_context(purpose_server: bool, main: MainConfig) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if purpose_server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = _VERSIONS[main.tls_min_version]
    if main.tls_ciphers:
        try:
            ctx.set_ciphers(main.tls_ciphers)
        except ssl.SSLError as exc:
            raise ConfigError(f"[main] tls_ciphers {main.tls_ciphers!r}: {exc}") from None
    return ctx


def _load_chain(ctx: ssl.SSLContext, cert: str, key: str, what: str) -> None:
    try:
        ctx.load_cert_chain(cert, key or None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"{what}: cannot load certificate {cert!r} / key {key or cert!r}: {exc}") from None


def _load_ca(ctx: ssl.SSLContext, main: MainConfig, purpose: ssl.Purpose) -> None:
    if main.tls_ca_cert:
        try:
            ctx.load_verify_locations(cafile=main.tls_ca_cert)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"[main] tls_ca_cert: cannot load {main.tls_ca_cert!r}: {exc}") from None
    else:
        ctx.load_default_certs(purpose)


def _server_context(main: MainConfig, cert: str, key: str, what: str) -> ssl.SSLContext:
    ctx = _base_context(True, main)
    ctx.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    _load_chain(ctx, cert, key, what)
    if main.tls_verify_peer:
        _load_ca(ctx, main, ssl.Purpose.CLIENT_AUTH)
        ctx.verify_mode = ssl.CERT_REQUIRED if main.tls_fail_if_no_peer_cert else ssl.CERT_OPTIONAL
    return ctx


class ServerTLS:
    """The current server contexts; ``context`` is read once per accepted connection."""

    def __init__(self, main: MainConfig) -> None:
        self.main = main
        self.context, self._by_name = self._build()

    def _build(self) -> tuple[ssl.SSLContext, dict[str, ssl.SSLContext]]:
        main = self.main
        by_name = {
            name: _server_context(main, cert, key, f"[main] tls_sni {name}")
            for name, (cert, key) in parse_sni(main.tls_sni).items()
        }
        default = _server_context(main, main.tls_cert, main.tls_key, "[main] tls_cert")
        if by_name:
            default.sni_callback = self._pick
        return default, by_name

    def _pick(self, sslobj: ssl.SSLObject | ssl.SSLSocket, name: str | None,
              ctx: ssl.SSLContext) -> int | None:
        if name:
            name = name.lower()
            chosen = self._by_name.get(name)
            if chosen is None and "." in name:
                chosen = self._by_name.get("*." + name.split(".", 1)[1])
            if chosen is not None:
                sslobj.context = chosen
        return None

    def reload(self) -> bool:
        """Re-read every certificate and key; keep the old contexts if any fails to load."""
        try:
            context, by_name = self._build()
        except ConfigError as exc:
            log.error("TLS reload failed, still serving the previous certificates: %s", exc)
            return False
        self.context, self._by_name = context, by_name
        log.info("TLS certificates reloaded (%d SNI name(s))", len(by_name))
        return True


class ReplicationTLS:
    """The replication link's contexts, reloadable (SIGHUP) like the client listeners'.

    The leader does not ask followers for a certificate (the cluster secret, inside TLS,
    authenticates them); a follower (and its proxy's tunnels) verifies the leader's certificate
    and host name against tls_ca_cert, so it never hands the secret to a node that cannot prove
    it is one of ours. asyncio's server keeps the one ``server`` context it was started with:
    its SNI callback, run for every ClientHello, hands the handshake to the current one.
    """

    def __init__(self, main: MainConfig) -> None:
        self.main = main
        self.current, self.client = self._build()
        self.server = _base_context(True, main)
        _load_chain(self.server, main.tls_cert, main.tls_key, "[main] tls_cert")
        self.server.sni_callback = self._pick

    def _build(self) -> tuple[ssl.SSLContext, ssl.SSLContext]:
        server = _base_context(True, self.main)
        _load_chain(server, self.main.tls_cert, self.main.tls_key, "[main] tls_cert")
        return server, client_context(self.main)

    def _pick(self, sslobj: ssl.SSLObject | ssl.SSLSocket, name: str | None,
              ctx: ssl.SSLContext) -> int | None:
        sslobj.context = self.current
        return None

    def reload(self) -> bool:
        """Re-read the certificate, key and CA; keep the old contexts if any fails to load.
        New connections (either side) use the new ones; established links keep their session."""
        try:
            self.current, self.client = self._build()
        except ConfigError as exc:
            log.error("replication TLS reload failed, still using the previous certificates: %s", exc)
            return False
        log.info("replication TLS certificates reloaded")
        return True


def replication_tls(main: MainConfig, on: bool) -> ReplicationTLS | None:
    """The replication link's TLS, or None when it runs in clear (no tls_cert, or
    ``[clustering] tls = false``)."""
    return ReplicationTLS(main) if on and enabled(main) else None


def client_context(main: MainConfig) -> ssl.SSLContext:
    """For this node's own TLS connections (replication link): verify the peer by tls_ca_cert
    and its host name; present tls_cert so a peer that asks for one gets it."""
    ctx = _base_context(False, main)
    _load_ca(ctx, main, ssl.Purpose.SERVER_AUTH)
    _load_chain(ctx, main.tls_cert, main.tls_key, "[main] tls_cert")
    return ctx


def _dn(rdns: Any) -> str:
    """A getpeercert() subject/issuer as an RFC 4514 string (last RDN first)."""
    parts = []
    for rdn in reversed(rdns or ()):
        parts.append("+".join(f"{_DN_NAMES.get(k, k)}={_escape(v)}" for k, v in rdn))
    return ",".join(parts)


def _escape(value: str) -> str:
    out = "".join("\\" + c if c in ',+"\\<>;=' else c for c in value)
    if out[:1] in ("#", " "):
        out = "\\" + out
    return out


@dataclass(frozen=True)
class PeerTLS:
    """What a finished server-side handshake tells about the connection."""

    protocol: str  # "TLSv1.3"
    cipher: str  # OpenSSL name, e.g. TLS_AES_256_GCM_SHA384
    cert: dict[str, Any]  # getpeercert(): empty unless the client sent a certificate that verified

    @classmethod
    def of(cls, sslobj: Any) -> PeerTLS | None:
        if sslobj is None:
            return None
        cipher = sslobj.cipher()
        return cls(sslobj.version() or "", cipher[0] if cipher else "", sslobj.getpeercert() or {})

    def login_name(self, source: str) -> str | None:
        """The EXTERNAL user name by ``[main] tls_cert_login_from``; None without a verified cert."""
        if not self.cert:
            return None
        if source == "distinguished_name":
            return _dn(self.cert.get("subject")) or None
        if source == "subject_alternative_name":
            for kind, value in self.cert.get("subjectAltName", ()):
                if kind in ("DNS", "email"):
                    return str(value)
            return None
        for rdn in self.cert.get("subject", ()):
            for key, value in rdn:
                if key == "commonName":
                    return str(value)
        return None

    def api_fields(self) -> dict[str, Any]:
        """The TLS fields of a RabbitMQ /api/connections entry."""
        cert = self.cert
        return {
            "ssl": True,
            "ssl_protocol": self.protocol.lower(),
            "ssl_cipher": self.cipher,
            "peer_cert_subject": _dn(cert.get("subject")) if cert else None,
            "peer_cert_issuer": _dn(cert.get("issuer")) if cert else None,
            "peer_cert_validity": f"{cert['notBefore']} - {cert['notAfter']}" if cert else None,
        }


NO_TLS_FIELDS: dict[str, Any] = {
    "ssl": False, "ssl_protocol": None, "ssl_cipher": None,
    "peer_cert_subject": None, "peer_cert_issuer": None, "peer_cert_validity": None,
}  # fmt: skip


# ------------------------------------------------------------------ a peer carried between members
#
# TLS ends at the node a client reached; a connection carried to the node serving its vhost
# (``cluster/elsewhere.py``, over a tunnel only a member holding the cluster secret opens) takes
# what that handshake verified along in the tunnel's hello, in PROXY protocol v2's own form for
# it, the PP2_TYPE_SSL TLV: a client byte (PP2_CLIENT_SSL, PP2_CLIENT_CERT_CONN when a certificate
# came), a u32 verify result (0: verified; getpeercert() reports only a certificate that verified),
# then sub-TLVs: PP2_SUBTYPE_SSL_VERSION, _CN, _CIPHER, and, in the range PROXY v2 leaves to
# applications (PP2_TYPE_MIN_CUSTOM), the rest of the verified certificate's fields the serving
# node's ``tls_cert_login_from`` and ``/api/connections`` read (subject, issuer,
# subjectAltName, validity) as JSON. The serving node applies its own EXTERNAL rules to them; it
# takes them only from a tunnel's hello, never from a client's bytes or a PROXY header.
PP2_TYPE_SSL = 0x20
PP2_SUBTYPE_SSL_VERSION, PP2_SUBTYPE_SSL_CN, PP2_SUBTYPE_SSL_CIPHER = 0x21, 0x22, 0x23
PP2_SUBTYPE_SKRED_CERT = 0xE0  # PP2_TYPE_MIN_CUSTOM: the certificate's fields, JSON
PP2_CLIENT_SSL, PP2_CLIENT_CERT_CONN = 0x01, 0x02
MAX_CARRIED = 16 * 1024  # bytes of a carried identity: a certificate's names fit many times over
_CERT_FIELDS = ("subject", "issuer", "subjectAltName", "notBefore", "notAfter")
_TLV = struct.Struct(">BH")
_SSL_HEAD = struct.Struct(">BI")


def _tlv(kind: int, value: bytes) -> bytes:
    if len(value) > MAX_CARRIED:
        raise ValueError("the client certificate's names are too long to carry")
    return _TLV.pack(kind, len(value)) + value


def carried(peer: PeerTLS) -> bytes:
    """``peer`` as the PP2_TYPE_SSL TLV a member sends with the connection it carries."""
    cert = peer.cert
    subs = _tlv(PP2_SUBTYPE_SSL_VERSION, peer.protocol.encode())
    subs += _tlv(PP2_SUBTYPE_SSL_CIPHER, peer.cipher.encode())
    if cert:
        fields = json.dumps({k: cert[k] for k in _CERT_FIELDS if k in cert}).encode()
        subs += _tlv(PP2_SUBTYPE_SSL_CN, (peer.login_name("common_name") or "").encode())
        subs += _tlv(PP2_SUBTYPE_SKRED_CERT, fields)
    client = PP2_CLIENT_SSL | (PP2_CLIENT_CERT_CONN if cert else 0)
    out = _tlv(PP2_TYPE_SSL, _SSL_HEAD.pack(client, 0) + subs)
    if len(out) > MAX_CARRIED:
        raise ValueError("the client certificate's names are too long to carry")
    return out


def from_carried(data: bytes) -> PeerTLS:
    """The peer a member carried (``carried``); ValueError for anything else."""
    if len(data) > MAX_CARRIED or len(data) < _TLV.size:
        raise ValueError("not a carried TLS peer")
    kind, size = _TLV.unpack_from(data)
    if kind != PP2_TYPE_SSL or size != len(data) - _TLV.size or size < _SSL_HEAD.size:
        raise ValueError("not a PP2_TYPE_SSL TLV")
    client, verify = _SSL_HEAD.unpack_from(data, _TLV.size)
    subs: dict[int, bytes] = {}
    pos = _TLV.size + _SSL_HEAD.size
    while pos < len(data):
        if pos + _TLV.size > len(data):
            raise ValueError("a cut sub-TLV")
        sub, n = _TLV.unpack_from(data, pos)
        pos += _TLV.size
        if pos + n > len(data):
            raise ValueError("a cut sub-TLV")
        subs[sub] = data[pos:pos + n]
        pos += n
    if not client & PP2_CLIENT_SSL:
        raise ValueError("the carried connection was not TLS")
    cert: dict[str, Any] = {}
    if client & PP2_CLIENT_CERT_CONN:
        if verify != 0:
            raise ValueError("a carried certificate that did not verify")
        cert = _cert_fields(subs.get(PP2_SUBTYPE_SKRED_CERT, b""))
    return PeerTLS(subs.get(PP2_SUBTYPE_SSL_VERSION, b"").decode(errors="replace"),
                   subs.get(PP2_SUBTYPE_SSL_CIPHER, b"").decode(errors="replace"), cert)


def _cert_fields(raw: bytes) -> dict[str, Any]:
    """getpeercert()'s shape back from JSON, checked: names are tuples of (key, value) pairs."""
    try:
        got = json.loads(raw)
    except ValueError:
        raise ValueError("a carried certificate that is not JSON") from None
    if not isinstance(got, dict) or not got.get("subject"):
        raise ValueError("a carried certificate with no subject")

    def pairs(items: Any) -> tuple[tuple[str, str], ...]:
        if not isinstance(items, list) or not all(
                isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in items):
            raise ValueError("a carried certificate's names are not (key, value) pairs")
        return tuple((str(k), str(v)) for k, v in items)

    cert: dict[str, Any] = {}
    for name in ("subject", "issuer"):
        rdns = got.get(name, [])
        if not isinstance(rdns, list):
            raise ValueError(f"a carried certificate's {name} is not a list")
        cert[name] = tuple(pairs(rdn) for rdn in rdns)
    if "subjectAltName" in got:
        cert["subjectAltName"] = pairs(got["subjectAltName"])
    for name in ("notBefore", "notAfter"):
        if isinstance(got.get(name), str):
            cert[name] = got[name]
    return cert
