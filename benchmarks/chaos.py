#!/usr/bin/env python3
"""Cluster chaos trials: every fault of ``tests/integration/cluster_faults.py``, N times each.

Runs the same trials as ``tests/integration/test_cluster_chaos.py`` (real etcd, three real
``skred --clustering`` processes, real kill -9, SIGSTOP, network namespaces), each fault
against a cluster of its own that is reused from trial to trial (a trial ends only once the
cluster is whole and in sync again), and prints a markdown table: trials, confirmed messages,
confirmed lost, resurrected acks (acked, then delivered again), missing redelivered flags
(delivered before the fault, delivered again without ``redelivered``), failover
min/median/max, and trials that missed a goal (with the first reason). Needs root for the
namespace faults (they are skipped otherwise).

    python benchmarks/chaos.py --trials 20
    python benchmarks/chaos.py --trials 3 --only "leader kill -9,etcd paused 0.7 TTL"
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from tests.integration.cluster_faults import (  # noqa: E402  (needs the repo root on sys.path)
    FAULTS,
    NetLab,
    Trial,
    make_cluster,
    netlab_unavailable,
    run_trial,
)


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
    ap.add_argument("--only", default="", help="comma-separated fault names (default: all)")
    args = ap.parse_args()
    for noisy in ("aiormq", "aio_pika"):  # clients cut off by a fault log tracebacks: expected here
        logging.getLogger(noisy).setLevel(logging.CRITICAL)
    names = [n.strip() for n in args.only.split(",") if n.strip()] or list(FAULTS)
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        ap.error(f"unknown fault(s) {unknown}; known: {list(FAULTS)}")
    results: dict[str, list[Trial]] = {}
    started = time.monotonic()
    for name in names:
        with tempfile.TemporaryDirectory(prefix="skred-chaos-") as tmp:
            print(f"{name}: {args.trials} trials", file=sys.stderr)
            results[name] = run_fault(name, args.trials, Path(tmp))
    print(table(results))
    print(f"\n{sum(len(t) for t in results.values())} trials in {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
