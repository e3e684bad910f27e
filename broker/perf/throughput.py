"""``skred-perf throughput``: set up queues, run producer/consumer processes, report.

Theory of operation: the parent opens a control connection, declares what the run needs (a
uniquely named queue unless ``-u`` names one; with ``--fanout-queues N`` a fanout exchange and N
bound queues), optionally pre-fills the queue(s) and waits until the broker reports them full,
then forks one process per client (``workers.py``). When every child has reported ready it sets
the shared ``go`` event; that instant is t=0 for all rates. Once a second it reads the shared
counters and prints a rate line with the tool's own CPU use (children from /proc, itself from
``os.times``).

Stopping: ``-z`` is a hard limit for everyone. Producers also stop after ``-C`` messages each.
When the number of messages to expect is known (``-C`` or ``--prefill``), consumers stop as soon
as they have them all, or when nothing arrived for ``--idle-stop`` seconds after the producers
finished. Ctrl-C stops everyone and still prints the summary. A client that fails (typically:
the broker went away) stops the whole run at once, saying why; the numbers after that would
measure nothing.
Rates are ``count / (time of the side's last useful work - t0)``, as amqp-perf does; the
per-second medians are printed too. Queues and exchanges the tool named itself are deleted, also
after the broker went away: the control connection is re-opened (for up to ``RECONNECT_FOR``
seconds) if it was lost, and what could not be deleted is named.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, TextIO

from broker.perf import codec
from broker.perf.client import CHANNEL, AmqpUri, Client
from broker.perf.handshake import PerfError
from broker.perf.stats import median, merge, new_histogram, percentiles
from broker.perf.workers import (
    SLOT_COUNT,
    SLOT_SETTLED,
    SLOTS,
    ConsumerJob,
    ProducerJob,
    message_body,
    run_child,
)

MIB = 1024 * 1024
RECONNECT_FOR = 30.0  # seconds teardown keeps trying to reach a broker that went away


@dataclass(frozen=True)
class ThroughputOptions:
    uri: str = "amqp://guest:guest@127.0.0.1:5672/"
    producers: int = 1
    consumers: int = 1
    size: int = 16
    seconds: float = 0.0
    count: int = 0
    ack_every: int = 0
    prefetch: int = 0
    confirm: int = 0
    persistent: bool = False
    queue: str = ""
    queue_durable: bool = False
    no_declare: bool = False
    exchange: str = ""
    routing_key: str = ""
    exchange_type: str = "direct"
    fanout_queues: int = 0
    prefill: int = 0
    latency: bool = False
    json: bool = False
    idle_stop: float = 5.0
    interval: float = 1.0
    batch_bytes: int = 65536
    message_ids: bool = False


@dataclass
class Topology:
    exchange: str
    routing_key: str
    queues: list[str]
    own_queues: list[str] = field(default_factory=list)
    own_exchange: str = ""


def _proc_cpu_seconds(pids: list[int]) -> float | None:
    """utime+stime of the given processes from /proc (None where /proc is unavailable)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            return None
        total += (int(fields[11]) + int(fields[12])) / tick  # fields 14 and 15 of stat(5)
    return total


def _self_cpu() -> float:
    t = os.times()
    return t.user + t.system


def setup(ctl: Client, opts: ThroughputOptions, run_id: str) -> Topology:
    durable = opts.queue_durable or opts.persistent
    if opts.fanout_queues:
        exchange = opts.exchange or f"skred-perf-{run_id}-fanout"
        topo = Topology(exchange, opts.routing_key, [])
        if not exchange.startswith("amq."):
            declare = codec.exchange_declare(CHANNEL, exchange, "fanout", durable=durable)
            ctl.rpc(declare, codec.EXCHANGE_DECLARE_OK)
            if not opts.exchange:
                topo.own_exchange = exchange
        for i in range(opts.fanout_queues):
            name = f"{opts.queue}-{i}" if opts.queue else f"skred-perf-{run_id}-{i}"
            ctl.rpc(codec.queue_declare(CHANNEL, name, durable=durable), codec.QUEUE_DECLARE_OK)
            topo.queues.append(name)
            if not opts.queue:
                topo.own_queues.append(name)
            ctl.rpc(codec.queue_bind(CHANNEL, name, exchange, ""), codec.QUEUE_BIND_OK)
        return topo
    name = opts.queue or f"skred-perf-{run_id}"
    ctl.rpc(
        codec.queue_declare(CHANNEL, name, durable=durable, passive=opts.no_declare), codec.QUEUE_DECLARE_OK
    )
    topo = Topology(opts.exchange, opts.routing_key or name, [name])
    if not opts.queue:
        topo.own_queues.append(name)
    if opts.exchange and not opts.no_declare:
        if not opts.exchange.startswith("amq."):
            ctl.rpc(
                codec.exchange_declare(CHANNEL, opts.exchange, opts.exchange_type, durable=durable),
                codec.EXCHANGE_DECLARE_OK,
            )
        ctl.rpc(codec.queue_bind(CHANNEL, name, opts.exchange, topo.routing_key), codec.QUEUE_BIND_OK)
    return topo


def queue_depth(ctl: Client, queue: str) -> int:
    payload = ctl.rpc(codec.queue_declare(CHANNEL, queue, passive=True), codec.QUEUE_DECLARE_OK)
    r = codec.Reader(payload)
    r.shortstr()
    return r.long()


def prefill(ctl: Client, opts: ThroughputOptions, topo: Topology, log: TextIO) -> None:
    """Publish ``opts.prefill`` messages and wait until every queue holds them."""
    msg = codec.encode_message(
        CHANNEL,
        topo.exchange,
        topo.routing_key,
        message_body(opts.size),
        ctl.frame_max,
        persistent=opts.persistent,
    )
    per_batch = max(1, min(4096, opts.batch_bytes // len(msg)))
    batch = msg * per_batch
    t0 = time.monotonic()
    left = opts.prefill
    before = {q: queue_depth(ctl, q) for q in topo.queues}
    while left > 0:
        k = min(per_batch, left)
        ctl.send(batch if k == per_batch else batch[: k * len(msg)])
        left -= k
    # Wait (bounded) until the broker has routed everything: depth is the truth, not our writes.
    deadline = time.monotonic() + max(60.0, opts.prefill / 10000)
    pending = list(topo.queues)
    while pending and time.monotonic() < deadline:
        pending = [q for q in pending if queue_depth(ctl, q) < before[q] + opts.prefill]
        if pending:
            time.sleep(0.1)  # polling the broker's depth; no event to wait on
    took = time.monotonic() - t0
    if pending:
        print(f"warning: prefill incomplete after {took:.1f} s: {pending}", file=log)
    else:
        print(f"prefilled {opts.prefill} messages in {took:.1f} s", file=log)


def _delete_own(ctl: Client, topo: Topology, log: TextIO) -> None:
    for q in topo.own_queues:
        ctl.rpc(codec.queue_delete(CHANNEL, q), codec.QUEUE_DELETE_OK, timeout=120.0)
        print(f"deleted queue {q}", file=log)
    if topo.own_exchange:
        ctl.rpc(codec.exchange_delete(CHANNEL, topo.own_exchange), codec.EXCHANGE_DELETE_OK)
        print(f"deleted exchange {topo.own_exchange}", file=log)


def teardown(ctl: Client, topo: Topology, log: TextIO) -> Client:
    """Delete what the run declared; returns the control client (a new one if it reconnected)."""
    try:
        _delete_own(ctl, topo, log)
        return ctl
    except (PerfError, codec.CodecError, OSError) as exc:
        print(f"connection to the broker lost ({exc}); reconnecting to delete what this run declared",
              file=log)
    deadline = time.monotonic() + RECONNECT_FOR
    while True:
        try:
            fresh = Client(ctl.uri, name="skred-perf cleanup")
        except (PerfError, codec.CodecError, OSError) as exc:
            if time.monotonic() >= deadline:
                names = ", ".join([*topo.own_queues, *filter(None, [topo.own_exchange])])
                print(f"could not delete {names}: broker unreachable ({exc})", file=log)
                return ctl
            time.sleep(0.5)  # retry interval of a bounded reconnect loop
            continue
        ctl.close()
        _delete_own(fresh, topo, log)
        return fresh


class Run:
    """The child processes of one throughput run and their shared state."""

    def __init__(self, opts: ThroughputOptions, topo: Topology) -> None:
        self.ctx = mp.get_context("fork")
        self.opts = opts
        jobs: list[ProducerJob | ConsumerJob] = []
        for _ in range(opts.producers):
            jobs.append(
                ProducerJob(
                    uri=opts.uri,
                    exchange=topo.exchange,
                    routing_key=topo.routing_key,
                    body_size=opts.size,
                    persistent=opts.persistent,
                    confirm_window=opts.confirm,
                    count=opts.count,
                    seconds=opts.seconds,
                    latency=opts.latency,
                    batch_bytes=opts.batch_bytes,
                    message_ids=opts.message_ids,
                )
            )
        n = 0
        for q in topo.queues:
            for _ in range(opts.consumers):
                jobs.append(
                    ConsumerJob(
                        uri=opts.uri,
                        queue=q,
                        ack_every=opts.ack_every,
                        prefetch=opts.prefetch,
                        latency=opts.latency,
                        tag=f"skred-perf-{n}",
                    )
                )
                n += 1
        self.jobs = jobs
        self.counters = self.ctx.RawArray("q", SLOTS * max(1, len(jobs)))
        self.stop_producers = self.ctx.RawValue("i", 0)
        self.stop_consumers = self.ctx.RawValue("i", 0)
        self.go = self.ctx.Event()
        self.procs: list[BaseProcess] = []
        self.pipes: list[Connection] = []
        self.results: list[dict[str, Any] | None] = [None] * len(jobs)

    def start(self) -> None:
        for slot, job in enumerate(self.jobs):
            parent_end, child_end = self.ctx.Pipe(duplex=False)
            is_producer = isinstance(job, ProducerJob)
            stop = self.stop_producers if is_producer else self.stop_consumers
            p = self.ctx.Process(
                target=run_child, args=(job, slot, self.counters, stop, self.go, child_end), daemon=True
            )
            p.start()
            child_end.close()
            self.procs.append(p)
            self.pipes.append(parent_end)

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        waiting = set(range(len(self.pipes)))
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PerfError(f"{len(waiting)} client(s) not ready after {timeout:g} s")
            for ready in wait([self.pipes[i] for i in waiting], timeout=left):
                i = self._index(ready)
                try:
                    msg = self.pipes[i].recv()
                except EOFError:
                    raise PerfError(f"client {i} exited during setup") from None
                if "error" in msg:
                    raise PerfError(f"client {i}: {msg['error']}")
                waiting.discard(i)

    def _index(self, ready: object) -> int:
        return next(i for i, p in enumerate(self.pipes) if p is ready)

    def counts(self) -> tuple[int, int, int, int]:
        """(published, settled, consumed, consumed bytes) summed over clients."""
        c = self.counters
        pub = settled = cons = nbytes = 0
        for slot, job in enumerate(self.jobs):
            if isinstance(job, ProducerJob):
                pub += c[slot * SLOTS + SLOT_COUNT]
                settled += c[slot * SLOTS + SLOT_SETTLED]
            else:
                cons += c[slot * SLOTS + SLOT_COUNT]
                nbytes += c[slot * SLOTS + SLOT_SETTLED]
        return pub, settled, cons, nbytes

    def producers_alive(self) -> bool:
        return any(
            p.is_alive() and self.results[i] is None
            for i, p in enumerate(self.procs)
            if isinstance(self.jobs[i], ProducerJob)
        )

    def collect(self, timeout: float) -> None:
        """Receive whatever results are available within ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            pending = [c for i, c in enumerate(self.pipes) if self.results[i] is None]
            left = deadline - time.monotonic()
            if not pending:
                return
            ready = wait(pending, timeout=max(0.0, left))
            if not ready and left <= 0:
                return
            for conn in ready:
                i = self._index(conn)
                try:
                    self.results[i] = self.pipes[i].recv()
                except EOFError:
                    self.results[i] = {"error": "client exited without a result"}

    def shutdown(self) -> None:
        self.stop_producers.value = 1
        self.stop_consumers.value = 1
        self.go.set()  # releases children still waiting to start; they see the stop flags
        self.collect(15.0)
        for p in self.procs:
            p.join(5.0)
            if p.is_alive():
                p.terminate()
                p.join(2.0)


def throughput(opts: ThroughputOptions, out: TextIO = sys.stdout) -> int:
    log = sys.stderr if opts.json else out
    uri = AmqpUri.parse(opts.uri)
    run_id = f"{os.getpid()}-{uuid.uuid4().hex[:6]}"
    ctl = Client(uri, name="skred-perf control")
    topo = setup(ctl, opts, run_id)
    for q in topo.own_queues:
        print(f"declared queue {q}", file=log)
    run: Run | None = None
    interrupted = False
    try:
        if opts.prefill:
            prefill(ctl, opts, topo, log)
        run = Run(opts, topo)
        run.start()
        run.wait_ready()
        summary, interrupted = _measure(run, opts, log)
    except KeyboardInterrupt:
        interrupted = True
        summary = None
    finally:
        if run is not None:
            run.shutdown()
        try:
            ctl = teardown(ctl, topo, log)
        finally:
            ctl.close()
    if summary is None:
        print("interrupted", file=log)
        return 130
    summary["server"] = {
        "product": str(ctl.server_properties.get("product", "")),
        "version": str(ctl.server_properties.get("version", "")),
    }
    summary["interrupted"] = interrupted
    summary["queues"] = topo.queues
    summary["deleted_queues"] = topo.own_queues
    assert run is not None
    errors = [r["error"] for r in run.results if r and "error" in r]
    summary["errors"] = errors
    _print_summary(summary, log)
    if opts.json:
        json.dump(summary, out)
        out.write("\n")
        out.flush()
    return 1 if errors else (130 if interrupted else 0)


def _measure(run: Run, opts: ThroughputOptions, log: TextIO) -> tuple[dict[str, Any], bool]:
    expected = 0
    fan = max(1, opts.fanout_queues)
    if opts.count:
        expected = opts.count * opts.producers * fan
    if opts.prefill:
        expected += opts.prefill * fan
    if not run.jobs or all(isinstance(j, ProducerJob) for j in run.jobs):
        expected = 0
    pids = [p.pid for p in run.procs if p.pid is not None]
    cpu_go = _proc_cpu_seconds(pids)
    self_go = _self_cpu()
    t0 = time.monotonic()
    run.go.set()
    deadline = t0 + opts.seconds if opts.seconds else float("inf")
    next_tick = t0 + opts.interval
    last = (0, 0, 0, 0)
    last_cpu = cpu_go
    last_self = self_go
    samples_pub: list[float] = []
    samples_cons: list[float] = []
    last_progress = t0
    interrupted = False
    has_producers = opts.producers > 0
    has_consumers = any(isinstance(j, ConsumerJob) for j in run.jobs)
    try:
        while True:
            now = time.monotonic()
            pub, settled, cons, nbytes = run.counts()
            if cons != last[2] or pub != last[0]:
                last_progress = now
            if now >= deadline:
                run.stop_producers.value = 1
            run.collect(0)
            failed = [r["error"] for r in run.results if r and "error" in r]
            if failed:
                print(f"stopping: a client failed ({failed[0]}); connection to the broker lost?", file=log)
                break
            producers_running = has_producers and run.producers_alive()
            # Consumers stop at the deadline, or once they have every message we know to expect
            # (or, when producers are finished, after --idle-stop seconds without progress).
            consumers_done = not has_consumers or now >= deadline or bool(expected and cons >= expected)
            idle = now - last_progress >= opts.idle_stop
            if not consumers_done and expected and not producers_running and idle:
                print(f"consumers idle for {opts.idle_stop:g} s; stopping at {cons}/{expected}", file=log)
                consumers_done = True
            if consumers_done:
                run.stop_consumers.value = 1  # freeze consumer counts now, not when producers return
                if not producers_running:
                    break
            if now >= next_tick:
                dt = now - (next_tick - opts.interval)
                cpu_now = _proc_cpu_seconds(pids)
                self_now = _self_cpu()
                cpu_pct = None
                if cpu_now is not None and last_cpu is not None:
                    cpu_pct = 100.0 * ((cpu_now - last_cpu) + (self_now - last_self)) / dt
                last_cpu, last_self = cpu_now, self_now
                rp = (pub - last[0]) / dt
                rc = (cons - last[2]) / dt
                samples_pub.append(rp)
                samples_cons.append(rc)
                line = f"[{now - t0:5.0f}s] published {rp:10.0f} msg/s  consumed {rc:10.0f} msg/s"
                if opts.confirm:
                    line += f"  confirmed {(settled - last[1]) / dt:10.0f} msg/s"
                if opts.size >= 65536 or opts.size * rc > MIB:
                    line += f"  {(nbytes - last[3]) / dt / MIB:8.1f} MiB/s"
                if cpu_pct is not None:
                    line += f"  tool cpu {cpu_pct:5.1f}%"
                print(line, file=log, flush=True)
                last = (pub, settled, cons, nbytes)
                next_tick += opts.interval
            time.sleep(min(0.02, max(0.0, next_tick - time.monotonic())))
    except KeyboardInterrupt:
        interrupted = True
    t_stop = time.monotonic()
    run.stop_producers.value = 1
    run.stop_consumers.value = 1
    run.collect(15.0)
    self_cpu = _self_cpu() - self_go
    return _summarise(run, opts, t0, t_stop, self_cpu, samples_pub, samples_cons), interrupted


def _summarise(
    run: Run,
    opts: ThroughputOptions,
    t0: float,
    t_stop: float,
    self_cpu: float,
    samples_pub: list[float],
    samples_cons: list[float],
) -> dict[str, Any]:
    published = confirmed = nacked = consumed = nbytes = 0
    pub_end = cons_end = t0
    cpu = self_cpu
    hist = new_histogram()
    for job, res in zip(run.jobs, run.results, strict=True):
        if not res or "error" in res:
            continue
        cpu += float(res.get("cpu", 0.0))
        if isinstance(job, ProducerJob):
            published += int(res["published"])
            confirmed += int(res["confirmed"])
            nacked += int(res["nacked"])
            pub_end = max(pub_end, float(res["end"]))
        else:
            consumed += int(res["consumed"])
            nbytes += int(res["bytes"])
            cons_end = max(cons_end, float(res["end"]))
            if res.get("latency"):
                merge(hist, res["latency"])
    elapsed = t_stop - t0
    pub_time = max(1e-9, pub_end - t0)
    cons_time = max(1e-9, cons_end - t0)
    summary: dict[str, Any] = {
        "elapsed_s": round(elapsed, 3),
        "published": published,
        "publish_rate": round(published / pub_time, 1) if published else 0.0,
        "publish_mib_s": round(published * opts.size / pub_time / MIB, 2) if published else 0.0,
        "consumed": consumed,
        "consume_rate": round(consumed / cons_time, 1) if consumed else 0.0,
        "consume_mib_s": round(nbytes / cons_time / MIB, 2) if consumed else 0.0,
        "median_1s_publish": round(median(samples_pub), 1),
        "median_1s_consume": round(median(samples_cons), 1),
        "tool_cpu_s": round(cpu, 3),
        "tool_cpu_percent": round(100.0 * cpu / max(elapsed, 1e-9), 1),
        "options": asdict(opts),
    }
    if opts.confirm:
        summary["confirmed"] = confirmed
        summary["nacked"] = nacked
        summary["confirm_rate"] = round((confirmed + nacked) / pub_time, 1) if confirmed + nacked else 0.0
    if opts.latency:
        summary["latency_us"] = percentiles(hist, (50, 95, 99))
    return summary


def _print_summary(s: dict[str, Any], log: TextIO) -> None:
    parts = [
        f"elapsed {s['elapsed_s']:.2f} s",
        f"published {s['published']} ({s['publish_rate']:.0f} msg/s)",
        f"consumed {s['consumed']} ({s['consume_rate']:.0f} msg/s, {s['consume_mib_s']:.1f} MiB/s)",
    ]
    if "confirmed" in s:
        parts.append(f"confirmed {s['confirmed']} nacked {s['nacked']} ({s['confirm_rate']:.0f} msg/s)")
    parts.append(f"tool cpu {s['tool_cpu_percent']:.0f}% of one core")
    print("summary: " + ", ".join(parts), file=log)
    lat = s.get("latency_us")
    if lat:
        print(
            "latency: " + "  ".join(f"{k} {v / 1000:.2f} ms" for k, v in lat.items()),
            file=log,
        )
    elif "latency_us" in s:
        print("latency: no samples", file=log)
    for err in s.get("errors", []):
        print(f"error: {err}", file=log)
    print(f"server: {s['server']['product']} {s['server']['version']}", file=log)
