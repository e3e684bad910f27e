"""A shovel's source on a remote AMQP 0-9-1 broker: a consuming connection of the shared link
layer (``broker/links/wire.py``: deliveries read in place off whole socket reads, pamqp for the
rest of the spec), with coalesced ``multiple`` acks (``broker/links/acks.py``).

The source queue is declared passively first; a missing one is declared durable with
``src-queue-args`` on a fresh channel (the passive declare closed the first). A ``src-exchange``
source declares an exclusive server-named queue and binds it with ``src-exchange-key``. The
consumer takes ``src-prefetch-count`` as its ``basic.qos`` window and ``src-consumer-args``
(``x-stream-offset`` only on the first run).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pamqp import commands

from broker.links.acks import ACK_DELAY, Acker
from broker.links.wire import Closed, Wire, open_first
from broker.shovel.definition import ShovelDef
from broker.shovel.ends import Message, Settle, new_lost

__all__ = ["ACK_DELAY", "AmqpSource", "client_properties"]


def client_properties(d: ShovelDef) -> dict[str, Any]:
    return {"connection_name": f"Shovel {d.name}", "product": "Skred shovel"}


class AmqpSource:
    can_dead_letter = False

    def __init__(self, d: ShovelDef, tag: str, args: dict[str, Any]) -> None:
        self.d = d
        self.tag = tag
        self.args = args  # consumer arguments for this run (x-stream-offset only on the first)
        self.lost = new_lost()
        self.length = 0
        self.wire: Wire | None = None
        self.acker: Acker | None = None

    async def open(self, on_message: Callable[[Message], None]) -> None:
        try:
            await self._open(on_message)
        except BaseException:
            await self.close()
            raise

    async def _open(self, on_message: Callable[[Message], None]) -> None:
        d = self.d
        self.wire, self.lost = await open_first([u.text for u in d.src_uris], client_properties(d), Wire)
        wire, channel = self.wire, 1
        await wire.call(channel, commands.Channel.Open(), commands.Channel.OpenOk)
        queue = d.src_queue or ""
        if queue:
            try:
                ok = await wire.call(channel, commands.Queue.Declare(queue=queue, passive=True),
                                     commands.Queue.DeclareOk)
            except Closed as exc:
                if exc.code != 404:
                    raise
                channel += 1  # a passive declare of a missing queue closed the channel
                await wire.call(channel, commands.Channel.Open(), commands.Channel.OpenOk)
                ok = await wire.call(channel, commands.Queue.Declare(queue=queue, durable=True,
                                                                     arguments=d.src_queue_args),
                                     commands.Queue.DeclareOk)
            assert isinstance(ok, commands.Queue.DeclareOk)
            if d.delete_after == "queue-length":
                self.length = ok.message_count or 0
        else:
            ok = await wire.call(channel, commands.Queue.Declare(exclusive=True, auto_delete=True,
                                                                 arguments=d.src_queue_args),
                                 commands.Queue.DeclareOk)
            assert isinstance(ok, commands.Queue.DeclareOk)
            queue = ok.queue or ""
            await wire.call(channel, commands.Queue.Bind(queue=queue, exchange=d.src_exchange or "",
                                                         routing_key=d.src_exchange_key),
                            commands.Queue.BindOk)
        await wire.call(channel, commands.Basic.Qos(prefetch_count=d.src_prefetch), commands.Basic.QosOk)
        no_ack = d.ack_mode == "no-ack"
        wire.channel, wire.on_message = channel, on_message
        self.acker = None if no_ack else Acker(wire, d.src_prefetch)  # nothing to settle without acks
        wire.consuming = True
        await wire.call(channel, commands.Basic.Consume(queue=queue, consumer_tag=self.tag, no_ack=no_ack,
                                                        arguments=self.args), commands.Basic.ConsumeOk)

    def settle(self, tag: int, how: Settle) -> None:
        """Coalesced acks (``broker/links/acks.py``); a requeue is written at once."""
        if self.acker is not None:
            self.acker.settle(tag, how is Settle.ACK)

    async def close(self) -> None:
        wire, self.wire = self.wire, None
        if self.acker is not None:
            self.acker.close()  # what was settled is acked before the connection goes
            self.acker = None
        if wire is None:
            return
        wire.on_message = wire.track = None
        await wire.shutdown("shovel closing")
