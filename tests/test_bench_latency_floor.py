"""benchmarks/workloads.py ``latency --direct``: the latency clients with no broker between
them (the floor that benchmarks/run.py's rows 5-floor-* report next to the broker rows)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("ack", [False, True])
def test_direct_latency_measures_every_message_without_a_broker(ack: bool) -> None:
    workloads = _load("workloads")
    r = workloads.latency("amqp://guest:guest@127.0.0.1:1/", 0.5, 2000, ack, direct=True)  # port 1: unused
    assert r["messages"] == 1000
    assert 0 < r["p50_ms"] <= r["p99_ms"] <= r["p999_ms"]
    assert r["server"]["product"].startswith("none")


def test_the_floor_rows_run_the_direct_latency_workload() -> None:
    run = _load("run")
    floor = {k: s for k, s in run.scenarios(1000).items() if k.startswith("5-floor-")}
    assert sorted(floor) == sorted(f"5-floor-{r}k-{p}" for r in (5, 20) for p in ("p50", "p99", "p99.9"))
    assert all(s.args[:3] == ("latency", "--direct", "--ack") for s in floor.values())
