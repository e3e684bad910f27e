"""AMQP methods that carry exchange or queue names, built without pamqp's name grammar.

pamqp checks exchange and queue names against the AMQP spec's domain grammar (letters, digits,
``-_.:@#,/+`` and space) both when a method object is built and when it is marshalled, and
raises ValueError for anything else. RabbitMQ accepts any UTF-8 name of up to 255 bytes, and
so does Skred: the definitions log (``broker/store/definitions.py``) stores these methods as
its records and the AMQP session answers queue.declare with queue.declare-ok, so a name such as
``ü`` or ``a<b`` must get through both. ``unchecked(cls)`` is a subclass of the pamqp class
whose ``validate`` does nothing; everything else (fields, encoding, ``isinstance`` against the
pamqp class) is pamqp's. The one limit that matters on the wire, 255 bytes of UTF-8 in a
short string, is enforced where names come in (``broker.auth.names``; an AMQP short string
cannot carry more), and pamqp's encoder still refuses a longer one.
"""

from __future__ import annotations

from typing import Any, TypeVar, cast

from pamqp import commands
from pamqp.base import Frame

F = TypeVar("F", bound=Frame)

_SUBCLASSES: dict[type[Frame], type[Frame]] = {}


def _no_check(self: Frame) -> None:
    """Names were checked where they came in (see the module docstring)."""


def unchecked(cls: type[F]) -> type[F]:
    """``cls`` without pamqp's name grammar (one subclass per class, made once)."""
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        # no __slots__ of its own: pamqp encodes the fields named by the inherited one
        attrs: dict[str, Any] = {"validate": _no_check, "__module__": __name__,
                                 "__qualname__": cls.__qualname__}
        sub = _SUBCLASSES[cls] = type(cls.__name__, (cls,), attrs)
    return cast("type[F]", sub)


ExchangeDeclare = unchecked(commands.Exchange.Declare)
ExchangeDelete = unchecked(commands.Exchange.Delete)
ExchangeBind = unchecked(commands.Exchange.Bind)
ExchangeUnbind = unchecked(commands.Exchange.Unbind)
QueueDeclare = unchecked(commands.Queue.Declare)
QueueDeclareOk = unchecked(commands.Queue.DeclareOk)
QueueDelete = unchecked(commands.Queue.Delete)
QueueBind = unchecked(commands.Queue.Bind)
QueueUnbind = unchecked(commands.Queue.Unbind)
