#!/usr/bin/env python3
"""LMQ over HTTP against AMQP on the same broker: put + get + ack round trips per second.

One client, one queue, 200-byte bodies, each message put, taken and acked before the next
(the way an LMQ worker uses the API): HTTP with keep-alive (aiohttp) and, for comparison, AMQP
with pika (publish with confirms, basic.get, basic.ack). Bounded by ``--count`` and ``--seconds``.

    python benchmarks/lmq_http.py --lmq http://127.0.0.1:9980 --amqp amqp://guest:guest@127.0.0.1:5672/%2F
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid

import aiohttp
import pika


async def lmq_rounds(base: str, count: int, seconds: float, body: bytes, user: str, password: str) -> float:
    q = f"bench-lmq-{uuid.uuid4().hex[:6]}"
    done = 0
    auth = {"Authorization": aiohttp.encode_basic_auth(user, password)}  # LMQ authenticates like AMQP
    async with aiohttp.ClientSession(headers=auth) as http:
        t0 = time.perf_counter()
        while done < count and time.perf_counter() - t0 < seconds:
            await (await http.post(f"{base}/messages/{q}", data=body)).read()
            r = await http.get(f"{base}/messages/{q}?t=1")
            await r.read()
            await (await http.post(f"{base}/messages/{q}/{r.headers['x-lmq-message-id']}?reply=ack")).read()
            done += 1
        elapsed = time.perf_counter() - t0
        await http.delete(f"{base}/queues/{q}")
    return done / elapsed


def amqp_rounds(url: str, count: int, seconds: float, body: bytes) -> float:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    q = f"bench-amqp-{uuid.uuid4().hex[:6]}"
    ch.queue_declare(q, durable=True)
    ch.confirm_delivery()
    done = 0
    t0 = time.perf_counter()
    while done < count and time.perf_counter() - t0 < seconds:
        ch.basic_publish("", q, body, pika.BasicProperties(delivery_mode=2))
        method, _props, _body = ch.basic_get(q)
        ch.basic_ack(method.delivery_tag)
        done += 1
    elapsed = time.perf_counter() - t0
    ch.queue_delete(q)
    conn.close()
    return done / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lmq", default="http://127.0.0.1:9980")
    ap.add_argument("--amqp", default="amqp://guest:guest@127.0.0.1:5672/%2F")
    ap.add_argument("--count", type=int, default=5000)
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()
    body = b"x" * 200
    amqp = pika.URLParameters(args.amqp).credentials  # the same user logs in to LMQ
    http = asyncio.run(lmq_rounds(args.lmq, args.count, args.seconds, body, amqp.username, amqp.password))
    amqp = amqp_rounds(args.amqp, args.count, args.seconds, body)
    print(f"{'path':<40} {'rounds/s':>10}")
    print(f"{'LMQ HTTP put+get+ack (keep-alive)':<40} {http:>10.0f}")
    print(f"{'AMQP publish(confirm)+get+ack (pika)':<40} {amqp:>10.0f}")


if __name__ == "__main__":
    main()
