"""SASL responses of AMQP's connection.start-ok, sans-IO.

``PLAIN`` (RFC 4616: ``authzid NUL user NUL password``) and RabbitMQ's
``AMQPLAIN`` (a field table with ``LOGIN`` and ``PASSWORD``) carry a password;
``EXTERNAL`` carries nothing we use: the user is the one the verified TLS
client certificate names (see ``broker.tls.PeerTLS.login_name``). HTTP's
``Authorization: Basic`` header (``basic_credentials``) carries the same pair for the
management API and LMQ's HTTP API.
"""

from __future__ import annotations

import base64
import binascii
import struct

from pamqp import decode as pdecode

from broker import errors

PASSWORD_MECHANISMS = ("PLAIN", "AMQPLAIN")
_U32 = struct.Struct(">I")


def credentials(mechanism: str, response: bytes) -> tuple[str, str]:
    """(user, password) from a PLAIN or AMQPLAIN response; ConnectionAccessRefused otherwise."""
    if mechanism == "PLAIN":
        parts = response.split(b"\x00")
        if len(parts) != 3:
            raise errors.ConnectionAccessRefused("malformed PLAIN response")
        return parts[1].decode(errors="replace"), parts[2].decode(errors="replace")
    if mechanism == "AMQPLAIN":
        try:
            _, table = pdecode.field_table(_U32.pack(len(response)) + response)
        except Exception:
            raise errors.ConnectionAccessRefused("malformed AMQPLAIN response") from None
        return str(table.get("LOGIN", "")), str(table.get("PASSWORD", ""))
    raise errors.ConnectionAccessRefused(f"unsupported mechanism {mechanism}")


def login_name(mechanism: str, response: bytes) -> str:
    """The user name a start-ok response logs in as, for the login throttle's key ("" when it
    names none: EXTERNAL, or malformed)."""
    try:
        return credentials(mechanism, response)[0]
    except errors.ConnectionAccessRefused:
        return ""


def basic_credentials(header: str) -> tuple[str, str] | None:
    """(user, password) from an HTTP ``Authorization: Basic`` header value; None when absent or malformed."""
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "basic" or not value:
        return None
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    user, sep, password = decoded.partition(":")
    return (user, password) if sep else None



def http_credentials(header: str) -> tuple[str, str, bool] | None:
    """(user, secret, bearer) from an HTTP ``Authorization`` header: Basic, or an OAuth 2 access
    token as ``Bearer`` (RFC 6750; the user is then the token's, "" here); None when neither."""
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "bearer":
        token = value.strip()
        return ("", token, True) if token else None
    creds = basic_credentials(header)
    return None if creds is None else (*creds, False)
