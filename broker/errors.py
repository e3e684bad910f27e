"""The AMQP error tree: one class per reply code.

Soft errors close the channel they happened on (channel.close); hard errors
close the whole connection (connection.close). Every error carries the reply
code and a human-readable text; ``class_id``/``method_id`` name the method that
failed (0/0 when none did). ``for_code()`` maps a reply code back to its class,
as peers report codes and the cluster/http layers re-raise them.
"""

from __future__ import annotations

import errno


class SkredError(Exception):
    """Base of every error Skred raises on purpose."""


class StoreError(SkredError):
    """A persistent file is unusable (corrupt, wrong version, locked)."""


class ListenError(SkredError, OSError):
    """A listener could not bind; the message names the option(s) that set its address."""

    def __init__(self, options: str, host: str, port: int, exc: OSError) -> None:
        super().__init__(f"cannot listen on {host}:{port} ({options}): {exc.strerror or exc}")


class DataDirLocked(StoreError):
    """Another process holds the data directory lock."""


class DiskFull(StoreError):
    """The store could not get disk space for a write (ENOSPC/EDQUOT).

    Raised by the store *before* anything partial becomes visible: the write did not happen and
    the store stays usable (reads, acks and deletes still work). Callers that publish answer it in
    their protocol (AMQP: nack the confirm / block the publisher), never by closing the connection.
    """


def no_space(exc: BaseException) -> bool:
    """Whether a write failed for want of disk space (the store's ``DiskFull``, or a raw
    ENOSPC/EDQUOT from a write path that does not translate it)."""
    if isinstance(exc, DiskFull):
        return True
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


class AMQPError(SkredError):
    reply_code: int = 0
    soft: bool = True

    def __init__(self, text: str = "", class_id: int = 0, method_id: int = 0) -> None:
        super().__init__(text)
        self.text = text
        self.class_id = class_id
        self.method_id = method_id

    @property
    def reply_text(self) -> str:
        name = type(self).__name__
        # RabbitMQ style: "NOT_FOUND - no queue 'x' in vhost '/'"
        return f"{_CONSTANT_NAMES.get(self.reply_code, name)} - {self.text}"[:255]


class SoftError(AMQPError):
    soft = True


class HardError(AMQPError):
    soft = False


# Soft (channel) errors.
class ContentTooLarge(SoftError):
    reply_code = 311


class NoRoute(SoftError):
    reply_code = 312


class NoConsumers(SoftError):
    reply_code = 313


class AccessRefused(SoftError):
    reply_code = 403


class NotFound(SoftError):
    reply_code = 404


class ResourceLocked(SoftError):
    reply_code = 405


class PreconditionFailed(SoftError):
    reply_code = 406


# Hard (connection) errors.
class ConnectionForced(HardError):
    reply_code = 320


class InvalidPath(HardError):
    reply_code = 402


class ConnectionAccessRefused(HardError):
    """403 during connection negotiation (bad credentials, vhost denied)."""

    reply_code = 403


class FrameError(HardError):
    reply_code = 501


class AMQPSyntaxError(HardError):
    reply_code = 502


class CommandInvalid(HardError):
    reply_code = 503


class ChannelError(HardError):
    reply_code = 504


class UnexpectedFrame(HardError):
    reply_code = 505


class ResourceError(HardError):
    reply_code = 506


class NotAllowed(HardError):
    reply_code = 530


class AMQPNotImplemented(HardError):
    reply_code = 540


class InternalError(HardError):
    reply_code = 541


_CONSTANT_NAMES = {
    311: "CONTENT_TOO_LARGE",
    312: "NO_ROUTE",
    313: "NO_CONSUMERS",
    320: "CONNECTION_FORCED",
    402: "INVALID_PATH",
    403: "ACCESS_REFUSED",
    404: "NOT_FOUND",
    405: "RESOURCE_LOCKED",
    406: "PRECONDITION_FAILED",
    501: "FRAME_ERROR",
    502: "SYNTAX_ERROR",
    503: "COMMAND_INVALID",
    504: "CHANNEL_ERROR",
    505: "UNEXPECTED_FRAME",
    506: "RESOURCE_ERROR",
    530: "NOT_ALLOWED",
    540: "NOT_IMPLEMENTED",
    541: "INTERNAL_ERROR",
}

_BY_CODE: dict[tuple[int, bool], type[AMQPError]] = {}
for _cls in (
    ContentTooLarge, NoRoute, NoConsumers, AccessRefused, NotFound, ResourceLocked,
    PreconditionFailed, ConnectionForced, InvalidPath, FrameError, AMQPSyntaxError,
    CommandInvalid, ChannelError, UnexpectedFrame, ResourceError, NotAllowed,
    AMQPNotImplemented, InternalError,
):
    _BY_CODE[(_cls.reply_code, _cls.soft)] = _cls
_BY_CODE.setdefault((403, False), ConnectionAccessRefused)


# The one mapping of the model's refusals to HTTP statuses, for every HTTP front end (the
# management API, LMQ): a refusal is the client's error (4xx), never a 500. (The management API
# then answers 403 as 401, as RabbitMQ's does.) Codes not listed are refusals of a request: 400.
HTTP_STATUS: dict[int, int] = {311: 413, 403: 403, 404: 404, 405: 405, 406: 400, 530: 400, 503: 400,
                               540: 501}


def http_status(exc: AMQPError) -> int:
    """The HTTP status that answers the model's refusal ``exc``."""
    return HTTP_STATUS.get(exc.reply_code, 400)


def for_code(code: int, soft: bool | None = None) -> type[AMQPError]:
    """The error class for a reply code (403 is soft unless ``soft=False``)."""
    if soft is not None and (code, soft) in _BY_CODE:
        return _BY_CODE[(code, soft)]
    for s in (True, False):
        if (code, s) in _BY_CODE:
            return _BY_CODE[(code, s)]
    raise KeyError(code)
