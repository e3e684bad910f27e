"""A shovel's destination on a remote AMQP 0-9-1 broker: the shared link layer's publisher
(``broker/links/publisher.py``: a turn's publishes framed at once from the raw property bytes,
confirms read in place and settled by range) on one channel, with ``on-confirm`` selecting
publisher confirms. ``dest-queue`` is declared unless it exists (passively first, on a channel
of its own: a missing queue closes it).
"""

from __future__ import annotations

from pamqp import commands

from broker.links.publisher import CHANNEL, Publisher, PublishWire
from broker.links.wire import Closed, open_first
from broker.shovel.amqp_source import client_properties
from broker.shovel.definition import ShovelDef


class AmqpDestination(Publisher):
    def __init__(self, d: ShovelDef) -> None:
        super().__init__(d.ack_mode == "on-confirm")
        self.d = d

    async def open(self) -> None:
        d = self.d
        wire, self.lost = await open_first([u.text for u in d.dest_uris], client_properties(d), PublishWire)
        self.wire = wire
        try:
            await wire.call(CHANNEL, commands.Channel.Open(), commands.Channel.OpenOk)
            if d.dest_queue:
                await self._ensure_queue(wire, d.dest_queue)
            if self.confirm:
                await wire.call(CHANNEL, commands.Confirm.Select(), commands.Confirm.SelectOk)
                wire.on_confirm = self._confirmed
            wire.consuming = True  # running: a close from now on is the link's end
        except BaseException:
            await self.close()
            raise

    async def _ensure_queue(self, wire: PublishWire, queue: str) -> None:
        """Declare the destination queue unless it exists (as the source does for its own):
        a passive declare first, on a channel of its own (a missing queue closes it)."""
        channel = CHANNEL + 1
        try:
            await wire.call(channel, commands.Channel.Open(), commands.Channel.OpenOk)
            passive = commands.Queue.Declare(queue=queue, passive=True)
            await wire.call(channel, passive, commands.Queue.DeclareOk)
        except Closed as exc:
            if exc.code != 404:
                raise
            channel += 1
            await wire.call(channel, commands.Channel.Open(), commands.Channel.OpenOk)
            declare = commands.Queue.Declare(queue=queue, durable=True, arguments=self.d.dest_queue_args)
            await wire.call(channel, declare, commands.Queue.DeclareOk)
        bye = commands.Channel.Close(reply_code=200, reply_text="declared", class_id=0, method_id=0)
        await wire.call(channel, bye, commands.Channel.CloseOk)

    async def close(self) -> None:
        wire = self.release()
        if wire is not None:
            await wire.shutdown("shovel closing")
