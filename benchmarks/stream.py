"""Stream-protocol publish and consume rates, Skred against RabbitMQ 3.10's stream plugin, with rstream.

Usage: ``python benchmarks/stream.py [--messages N] [--size B] [--batch K] [--runs R] [--client C]``

Both brokers are private (a Skred data dir and a RabbitMQ node of our own on free ports, the
conformance harness's ``RabbitProcess`` with ``stream=True``), measured alternately in one run so
the machine's load hits both alike. Per run and broker: a fresh stream; one rstream producer
publishes N messages of B bytes in ``send_batch`` calls of K (each waits for its confirms), then
one consumer reads the N from the first offset. Reported: messages per second (wall clock) and
the broker's CPU time per message (user + system of the broker process: Skred's Python process,
RabbitMQ's Erlang VM over both cores), medians over the runs. The Python client is usually the
bottleneck of the wall-clock rates, which makes the CPU per message the figure to compare.

``--client raw`` (or ``both``) measures with the fast load generator of ``_streamload.py``
instead: Publish frames of K messages pipelined (a window of ``--window`` frames unconfirmed),
a consumer with a large credit. That client costs little CPU per message, so the brokers are
the bottleneck and the wall-clock rates mean something too.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import _streamload  # noqa: E402
from rstream import Consumer, ConsumerOffsetSpecification, MessageContext, OffsetType, Producer  # noqa: E402

from tests.integration._support import SkredProcess  # noqa: E402  (needs the repo root)
from tests.integration.conformance._rabbit import RabbitProcess  # noqa: E402

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """CPU of ``pid`` and every process below it (a broker may run workers or sit under a
    wrapper): utime + stime + the reaped children's, summed over the live tree."""
    stats: dict[int, tuple[int, int]] = {}  # pid -> (parent, ticks)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        stats[int(entry.name)] = (int(fields[1]), sum(int(f) for f in fields[11:15]))
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, (ppid, _ticks) in stats.items():
            if ppid == parent and child not in tree:
                tree.add(child)
                frontier.append(child)
    return sum(stats[p][1] for p in tree if p in stats) / _TICK


async def publish(port: int, stream: str, n: int, size: int, batch: int) -> None:
    body = b"x" * size
    async with Producer("127.0.0.1", port=port, username="guest", password="guest") as p:
        await p.create_stream(stream)
        for _ in range(n // batch):
            await p.send_batch(stream, [body] * batch)


async def consume(port: int, stream: str, n: int, deadline_s: float) -> None:
    got = 0
    done = asyncio.Event()

    def on_message(_msg: bytes, _ctx: MessageContext) -> None:
        nonlocal got
        got += 1
        if got >= n:
            done.set()

    c = Consumer("127.0.0.1", port=port, username="guest", password="guest")
    await c.start()
    try:
        await c.subscribe(stream, on_message, initial_credit=32,
                          offset_specification=ConsumerOffsetSpecification(OffsetType.FIRST, None))
        await asyncio.wait_for(done.wait(), deadline_s)
    finally:
        await c.close()


def measure(name: str, port: int, pid: int, n: int, size: int, batch: int, client: str,
            window: int) -> dict[str, float]:
    stream = f"bench-{uuid.uuid4().hex[:8]}"
    c0, t0 = cpu_seconds(pid), time.monotonic()
    if client == "raw":
        asyncio.run(_streamload.publish(port, stream, n, size, batch, window, 600))
    else:
        asyncio.run(asyncio.wait_for(publish(port, stream, n, size, batch), 600))
    c1, t1 = cpu_seconds(pid), time.monotonic()
    if client == "raw":
        asyncio.run(_streamload.consume(port, stream, n, 1000, 600))
    else:
        asyncio.run(consume(port, stream, n, 600))
    c2, t2 = cpu_seconds(pid), time.monotonic()
    out = {"publish msg/s": n / (t1 - t0), "consume msg/s": n / (t2 - t1),
           "publish broker CPU us/msg": (c1 - c0) / n * 1e6, "consume broker CPU us/msg": (c2 - c1) / n * 1e6}
    print(f"  {name} ({client}): " + ", ".join(f"{k} {v:,.1f}" for k, v in out.items()), flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=200_000)
    ap.add_argument("--size", type=int, default=16)
    ap.add_argument("--batch", type=int, default=500)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--client", choices=("rstream", "raw", "both"), default="both")
    ap.add_argument("--window", type=int, default=16, help="raw client: Publish frames unconfirmed")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="stream-bench-") as tmp:
        skred = SkredProcess(Path(tmp) / "skred")
        rabbit = RabbitProcess(Path(tmp) / "rabbitmq", management=False, stream=True, name="streambench")
        try:
            skred.start()
            rabbit.spawn()
            problem = rabbit.wait_ready()
            if problem:
                print(problem, file=sys.stderr)
                return 1
            assert skred.pid is not None
            brokers = {"skred": (skred.stream_port, skred.pid),
                       "rabbitmq": (rabbit.stream_port or 0, rabbit.beam_pid())}
            clients = ("rstream", "raw") if args.client == "both" else (args.client,)
            results: dict[tuple[str, str], list[dict[str, float]]] = {
                (b, c): [] for c in clients for b in brokers}
            load0 = os.getloadavg()
            for run in range(args.runs):
                print(f"run {run + 1}/{args.runs}", flush=True)
                for client in clients:
                    for name, (port, pid) in brokers.items():
                        results[name, client].append(measure(name, port, pid, args.messages, args.size,
                                                             args.batch, client, args.window))
            load1 = os.getloadavg()
        finally:
            skred.close()
            rabbit.close()
    print(f"\n{args.messages:,} messages of {args.size} B, send_batch of {args.batch}, {args.runs} runs, "
          f"medians; load average {load0[0]:.1f} at the start, {load1[0]:.1f} at the end\n")
    print("| client | measure | Skred | RabbitMQ 3.10 | Skred / RabbitMQ |\n|---|---|---|---|---|")
    for client in clients:
        for key in results["skred", client][0]:
            s = statistics.median(r[key] for r in results["skred", client])
            r = statistics.median(x[key] for x in results["rabbitmq", client])
            print(f"| {client} | {key} | {s:,.1f} | {r:,.1f} | {s / r:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
