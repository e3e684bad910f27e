#!/usr/bin/env python3
"""Chaos trials: every fault of ``tests/integration/cluster_faults.py`` and of
``tests/integration/single_faults.py``, N times each.

Single node (one broker process per fault, killed with SIGKILL and restarted on its data dir):
kill -9 under live traffic, after settlements (acks, rejects, nacks, purges, held deliveries)
with the default sync window and with synchronous acks, a full disk (a small tmpfs in a
private mount namespace; needs root), a bounded fuzz of malformed frames and property
lists, and kill -9 of one worker of a 2-worker node (``worker_faults.py``). Printed as a
second table: confirmed lost, settlements older than the window that came
back, missing redelivered flags, broker deaths, tracebacks, wrong answers.

Cluster:

Runs the same trials as ``tests/integration/test_cluster_chaos.py`` (real etcd, three real
``skred --clustering`` processes, real kill -9, SIGSTOP, network namespaces), each fault
against a cluster of its own that is reused from trial to trial (a trial ends only once the
cluster is whole and in sync again), and prints a markdown table: trials, confirmed messages,
confirmed lost, resurrected acks (acked, then delivered again), missing redelivered flags
(delivered before the fault, delivered again without ``redelivered``), failover
min/median/max, and trials that missed a goal (with the first reason). Needs root for the
namespace faults (they are skipped otherwise).

    python benchmarks/chaos.py --trials 20
    python benchmarks/chaos.py --trials 3 --only "leader kill -9,etcd paused 0.7 TTL" --single none
    python benchmarks/chaos.py --trials 20 --only none --single "live,full disk"

Per-shard leaders (``[clustering] shard_leaders``, ``tests/integration/shard_faults.py``):
``--shards N`` runs N trials of kill -9 of a node leading two of six shards (not the cluster
leader: the data path is still its), on one cluster: failover of the moved shards, the largest
confirm gap of a publisher on another shard, the hand-back on return, confirmed lost.

    python benchmarks/chaos.py --only none --single none --shards 5

``--drains N`` runs N trials of SIGTERM to the cluster leader, which leads shards of its own
(``shard_faults.drain_and_return``): how soon its shards are led elsewhere, its client's
reconnects, the hand-back on return, confirmed lost.

    python benchmarks/chaos.py --only none --single none --drains 5
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tests.integration import shard_faults as shf  # noqa: E402
from tests.integration import single_faults as sf  # noqa: E402
from tests.integration import worker_faults as wf  # noqa: E402
from tests.integration._support import SkredProcess  # noqa: E402
from tests.integration._tmpfs import NamespacedBroker, mount_tmpfs  # noqa: E402
from tests.integration.cluster_faults import (  # noqa: E402  (needs the repo root on sys.path)
    FAULTS,
    NetLab,
    Trial,
    make_cluster,
    netlab_unavailable,
    run_trial,
)

SingleRun = Callable[[SkredProcess, random.Random], sf.Trial]


def _full_disk(b: SkredProcess, rng: random.Random) -> sf.Trial:
    assert isinstance(b, NamespacedBroker)
    return sf.trial_full_disk(b, rng, b.data_dir.parent, b.run_inside)  # data dir: <tmpfs>/data

SINGLE: dict[str, tuple[SingleRun, list[str]]] = {
    "live": (sf.trial_live, []),
    "settled": (sf.trial_settled, []),
    "settled, synchronous": (lambda b, rng: sf.trial_settled(b, rng, synchronous=True),
                             ["--ack-sync-interval", "0"]),
    "full disk": (lambda b, rng: _full_disk(b, rng), ["--free-disk-min", "0", "--segment-size", "256KiB"]),
    "fuzz frames": (lambda b, rng: sf.trial_fuzz(b, rng, "frames"), []),
    "fuzz properties": (lambda b, rng: sf.trial_fuzz(b, rng, "properties"), []),
    "worker kill -9": (wf.trial_worker_kill, ["--workers", str(wf.WORKERS)]),
}
SINGLE_WHAT = {
    "live": "kill -9 at a random moment under confirmed publishing and acking",
    "settled": "kill -9 1.5 s after acks, rejects, nacks, a purge and held deliveries",
    "settled, synchronous": "the same with ack_sync_interval = 0, kill -9 at once",
    "full disk": "pipelined confirmed publishes to two queues until nacks, kill -9",
    "fuzz frames": "25 malformed frames per trial",
    "fuzz properties": "25 malformed property lists per trial",
    "worker kill -9": "2 workers: kill -9 of one under live traffic on its vhost; the other's publisher "
                      f"must see no gap over {wf.GAP_BOUND:g} s",
}


def run_single(name: str, trials: int, tmp: Path) -> list[sf.Trial]:
    run, args = SINGLE[name]
    rng = random.Random()
    tmpfs = None
    if name == "full disk":
        if os.geteuid() != 0:
            print(f"skipping {name!r}: needs root", file=sys.stderr)
            return []
        tmpfs = mount_tmpfs(tmp, 16 * 1024 * 1024)
        mnt, holder = next(tmpfs)
        b: SkredProcess = NamespacedBroker(mnt / "data", holder, args)
        b.log_path = tmp / "broker.log"
    else:
        b = SkredProcess(tmp / "data", args)
    out: list[sf.Trial] = []
    try:
        b.start()
        if name == "worker kill -9":
            wf.prepare(b)
        for i in range(trials):
            t0 = time.monotonic()
            t = run(b, rng)
            out.append(t)
            print(f"  {name} #{i + 1}: {t} ({time.monotonic() - t0:.0f}s)", file=sys.stderr)
    finally:
        b.close()
        if tmpfs is not None:
            tmpfs.close()
    return out


def single_table(results: dict[str, list[sf.Trial]]) -> str:
    rows = ["| fault | trials | confirmed | confirmed lost | settled before the window | resurrected "
            "| settled inside the window, back (allowed) | delivered | missing redelivered "
            "| fuzz inputs | broker deaths | tracebacks | wrong answers | goal missed |",
            "| --- " + "| ---: " * 12 + "| --- |"]
    for name, trials in results.items():
        def total(attr: str, ts: list[sf.Trial] = trials) -> int:
            return sum(getattr(t, attr) for t in ts)
        missed = [t for t in trials if t.notes or t.lost or t.resurrected or t.missing_redelivered
                  or t.deaths or t.tracebacks or t.wrong]
        why = f"{len(missed)}" + (f" ({missed[0].notes[0]})" if missed and missed[0].notes else "")
        rows.append(f"| {name} ({SINGLE_WHAT[name]}) | {len(trials)} | {total('confirmed')} "
                    f"| {total('lost')} "
                    f"| {total('settled')} | {total('resurrected')} | {total('recent_back')} "
                    f"| {total('delivered')} | {total('missing_redelivered')} | {total('inputs')} "
                    f"| {total('deaths')} | {total('tracebacks')} | {total('wrong')} | {why} |")
    return "\n".join(rows)


def run_fault(name: str, trials: int, tmp: Path) -> list[Trial]:
    fault = FAULTS[name]
    lab: NetLab | None = None
    if fault.lab:
        why = netlab_unavailable()
        if why:
            print(f"skipping {name!r}: {why}", file=sys.stderr)
            return []
        lab = NetLab()
    c = make_cluster(tmp, name, lab)
    out: list[Trial] = []
    try:
        for n in c.nodes:
            n.start()
        for i in range(trials):
            t0 = time.monotonic()
            try:
                trial = run_trial(c, name, f"chaos-{i}", lab)
            except AssertionError as exc:  # the cluster did not come back: count it, stop this fault
                trial = Trial(name, notes=[f"cluster did not recover: {str(exc).splitlines()[0]}"])
                out.append(trial)
                print(f"  {name} #{i + 1}: {trial.notes[0]}", file=sys.stderr)
                break
            out.append(trial)
            print(f"  {name} #{i + 1}: confirmed {trial.confirmed} lost {trial.lost} "
                  f"resurrected {trial.resurrected} no-redelivered {trial.missing_redelivered} "
                  f"failover {trial.failover if trial.failover is None else round(trial.failover, 2)} "
                  f"{'; '.join(trial.notes)} ({time.monotonic() - t0:.0f}s)", file=sys.stderr)
    finally:
        if lab is not None:
            lab.heal()
        c.close()
        if lab is not None:
            lab.close()
    return out


T = TypeVar("T", shf.ShardTrial, shf.DrainTrial)


@dataclass(frozen=True)
class ShardRun(Generic[T]):
    """One per-shard fault run on one cluster: what it is called, the seed of its choices, one
    trial, the trial that stands for "the cluster did not come back", its progress line and its
    table (``--shards`` and ``--drains`` differ only in these)."""

    what: str
    tag: str  # prefix of the queue names of a trial
    seed: int
    one: Callable[[shf.ShardCluster, str, random.Random], T]
    failed: Callable[[list[str]], T]
    line: Callable[[T], str]
    table: Callable[[list[T]], str]

    def run(self, trials: int, tmp: Path) -> list[T]:
        """``trials`` runs of ``one`` on one per-shard cluster; a cluster that does not come back
        counts as ``failed([why])`` and ends the runs."""
        sc = shf.ShardCluster(tmp)
        rng = random.Random(self.seed)
        out: list[T] = []
        try:
            for i in range(trials):
                t0 = time.monotonic()
                try:
                    trial = self.one(sc, f"{self.tag}-{i}", rng)
                except AssertionError as exc:  # the cluster did not come back: count it, stop here
                    out.append(self.failed([f"cluster did not recover: {str(exc).splitlines()[0]}"]))
                    break
                out.append(trial)
                print(f"  #{i + 1}: {self.what}: {self.line(trial)} {'; '.join(trial.notes)} "
                      f"({time.monotonic() - t0:.0f}s)", file=sys.stderr)
        finally:
            sc.close()
        return out


def _span(values: list[float | None]) -> str:
    got = [v for v in values if v is not None]
    return f"{min(got):.2f} / {statistics.median(got):.2f} / {max(got):.2f}" if got else "-"


def drain_table(trials: list[shf.DrainTrial]) -> str:
    missed = [t for t in trials if t.notes or t.lost or t.moved_in is None or t.moved_in > shf.TTL
              or t.resigned != t.moved or t.exit_code != 0]
    why = f"{len(missed)}" + (f" ({missed[0].notes[0]})" if missed and missed[0].notes else "")
    return "\n".join([
        "| fault | TTL | trials | confirmed | confirmed lost "
        "| its shards led elsewhere min / median / max (s) | bound (s) | client reconnects "
        "| hand-back after restart (s) | goal missed |",
        "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- | --- |",
        f"| SIGTERM of the cluster leader (drain) | {shf.TTL} | {len(trials)} "
        f"| {sum(t.confirmed for t in trials)} | {sum(t.lost for t in trials)} "
        f"| {_span([t.moved_in for t in trials])} | {shf.TTL} | {sum(t.reconnects for t in trials)} "
        f"| {_span([t.handback for t in trials])} | {why} |"])


def shard_table(trials: list[shf.ShardTrial]) -> str:
    span = _span

    missed = [t for t in trials if t.notes or t.lost or t.failover is None or t.failover > shf.BOUND
              or (t.largest_gap or 0) >= 1.0]
    why = f"{len(missed)}" + (f" ({missed[0].notes[0]})" if missed and missed[0].notes else "")
    return "\n".join([
        "| fault | TTL | trials | confirmed | confirmed lost | failover of its shards min / median / max (s) "
        "| bound (s) | other shard's largest confirm gap (s) | hand-back after restart (s) | goal missed |",
        "| --- | ---: | ---: | ---: | ---: | --- | ---: | --- | --- | --- |",
        f"| shard leader kill -9 (2 of 7 shards) | {shf.TTL} | {len(trials)} "
        f"| {sum(t.confirmed for t in trials)} | {sum(t.lost for t in trials)} "
        f"| {span([t.failover for t in trials])} | {shf.BOUND} "
        f"| {span([t.largest_gap for t in trials])} | {span([t.handback for t in trials])} | {why} |"])


SHARD_RUNS: dict[str, ShardRun[shf.ShardTrial] | ShardRun[shf.DrainTrial]] = {
    "shards": ShardRun(
        "shard leader kill -9", "chaos", 27, shf.kill_and_return, lambda notes: shf.ShardTrial(notes=notes),
        lambda t: (f"{t.victim} {t.moved} failover {t.failover} gap {t.largest_gap} "
                   f"hand-back {t.handback} confirmed {t.confirmed} lost {t.lost}"),
        shard_table),
    "drains": ShardRun(
        "shard drain", "drain", 2736, shf.drain_and_return, lambda notes: shf.DrainTrial(notes=notes),
        lambda t: (f"{t.victim} {t.moved} moved in {t.moved_in} exit {t.exit_code} reconnects "
                   f"{t.reconnects} hand-back {t.handback} confirmed {t.confirmed} lost {t.lost}"),
        drain_table),
}


def table(results: dict[str, list[Trial]]) -> str:
    rows = ["| fault | TTL | trials | confirmed | confirmed lost | resurrected acks | missing redelivered "
            "| failover min / median / max (s) | bound (s) | goal missed |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | --- |"]
    for name, trials in results.items():
        fault = FAULTS[name]
        times = [t.failover for t in trials if t.failover is not None]
        span = (f"{min(times):.2f} / {statistics.median(times):.2f} / {max(times):.2f}"
                if times else "-")
        missed = [t for t in trials if t.notes or t.lost or t.resurrected or t.missing_redelivered
                  or (t.failover is not None and t.failover > fault.bound)]
        why = f"{len(missed)}" + (f" ({missed[0].notes[0]})" if missed and missed[0].notes else "")
        rows.append(f"| {name} ({fault.what}) | {fault.ttl} | {len(trials)} "
                    f"| {sum(t.confirmed for t in trials)} | {sum(t.lost for t in trials)} "
                    f"| {sum(t.resurrected for t in trials)} | {sum(t.missing_redelivered for t in trials)} "
                    f"| {span} | {fault.bound:g} | {why} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20, help="trials per fault (default 20)")
    ap.add_argument("--only", default="", help="comma-separated cluster fault names (default: all; none)")
    ap.add_argument("--single", default="", help="comma-separated single-node fault names "
                    "(default: all; none)")
    ap.add_argument("--shards", type=int, default=0, help="trials of the per-shard leader fault (default 0)")
    ap.add_argument("--drains", type=int, default=0, help="trials of the shard drain on SIGTERM (default 0)")
    args = ap.parse_args()
    for noisy in ("aiormq", "aio_pika", "pika"):  # clients cut off by a fault log tracebacks: expected here
        logging.getLogger(noisy).setLevel(logging.CRITICAL)

    def pick(arg: str, known: list[str]) -> list[str]:
        if arg.strip() == "none":
            return []
        names = [n.strip() for n in arg.split(",") if n.strip()] or known
        unknown = [n for n in names if n not in known]
        if unknown:
            ap.error(f"unknown fault(s) {unknown}; known: {known}")
        return names

    cluster_names = pick(args.only, list(FAULTS))
    single_names = pick(args.single, list(SINGLE))
    started = time.monotonic()
    load = os.getloadavg()
    singles: dict[str, list[sf.Trial]] = {}
    for name in single_names:
        with tempfile.TemporaryDirectory(prefix="skred-chaos-") as tmp:
            print(f"{name}: {args.trials} trials", file=sys.stderr)
            singles[name] = run_single(name, args.trials, Path(tmp))
    results: dict[str, list[Trial]] = {}
    for name in cluster_names:
        with tempfile.TemporaryDirectory(prefix="skred-chaos-") as tmp:
            print(f"{name}: {args.trials} trials", file=sys.stderr)
            results[name] = run_fault(name, args.trials, Path(tmp))
    shard_tables: list[str] = []
    trial_count = 0
    for key, shard_run in SHARD_RUNS.items():
        if getattr(args, key) > 0:
            with tempfile.TemporaryDirectory(prefix="skred-chaos-") as tmp:
                print(f"{shard_run.what}: {getattr(args, key)} trials", file=sys.stderr)
                got = shard_run.run(getattr(args, key), Path(tmp))
            shard_tables.append(shard_run.table(got))  # type: ignore[arg-type]
            trial_count += len(got)
    if singles:
        print(single_table(singles) + "\n")
    for shard_text in shard_tables:
        print(shard_text + "\n")
    if results:
        print(table(results) + "\n")
    n = sum(len(t) for t in results.values()) + sum(len(t) for t in singles.values()) + trial_count
    end = os.getloadavg()
    print(f"{n} trials in {time.monotonic() - started:.0f}s; load average (1 min) {load[0]:.1f} at the "
          f"start, {end[0]:.1f} at the end, on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
