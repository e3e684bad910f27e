"""``broker/http/records_budget.ByteBudget`` with no sockets: first come first served, a wait
that ends takes nothing, resizing to the answer's real size, and an ask above the limit."""

from __future__ import annotations

import asyncio

from broker.http.records_budget import ByteBudget


def test_waiters_are_served_in_order_and_a_timed_out_wait_takes_nothing() -> None:
    async def run() -> None:
        b = ByteBudget(100)
        assert await b.take(80, 0)
        assert not await b.take(30, 0)  # no wait: refused at once
        assert not await b.take(30, 0.01)  # waited, timed out: nothing taken
        assert b.used == 80
        big = asyncio.create_task(b.take(100, 5))
        small = asyncio.create_task(b.take(10, 5))
        await asyncio.sleep(0)
        assert not small.done()  # 10 would fit, but the larger waiter came first
        b.give(80)
        assert await big and b.used == 100
        assert not small.done()
        b.give(100)
        assert await small and b.used == 10
        b.give(10)
        assert b.used == 0

    asyncio.run(run())


def test_resize_and_asks_above_the_limit() -> None:
    async def run() -> None:
        b = ByteBudget(100)
        assert await b.take(1000, 0)  # asked the whole budget
        assert b.used == 100
        waiter = asyncio.create_task(b.take(50, 5))
        await asyncio.sleep(0)
        held = b.resize(100, 30)  # the answer was smaller: the rest lets the waiter in
        assert await waiter and b.used == 80
        held = b.resize(held, 120)  # one record larger than asked: counted, over the limit
        assert b.used == 170
        b.give(held)
        b.give(50)
        assert b.used == 0

    asyncio.run(run())


def test_a_cancelled_waiter_leaves_the_queue() -> None:
    async def run() -> None:
        b = ByteBudget(100)
        assert await b.take(100, 0)
        first = asyncio.create_task(b.take(100, 5))
        second = asyncio.create_task(b.take(40, 5))
        await asyncio.sleep(0)
        first.cancel()  # the client went away while waiting
        await asyncio.sleep(0)
        b.give(60)
        assert await second and b.used == 80

    asyncio.run(run())
