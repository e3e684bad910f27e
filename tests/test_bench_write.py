"""benchmarks/run.py --write with --only: a partial rerun replaces its scenarios' rows in
docs/benchmarks.md and keeps every other recorded result (it used to rewrite the whole file)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"

HEADER = "| scenario | what | unit | Skred (median) | RabbitMQ (median) |"
SEP = "|---|---|---|---|---|"
OLD = "\n".join([
    "# Benchmarks", "", "Written by `benchmarks/run.py`.", "", "Run: yesterday.", "",
    "## Machine", "", "- nproc: 2", "",
    "## Results", "", HEADER, SEP,
    "| a | 16 B | msg/s | 1,000 | 100 |",
    "| 8-fill | fill | msg/s | 70 | 15 |",
    "| 8-rss | rss | MiB | 51 | 3,417 |",
    "",
    "## Errors", "", "- (a) peer run 2: timed out", "- (8-fill) peer run 1: blocked", "",
])


@pytest.fixture(scope="module")
def run() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_run", BENCH / "run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_run"] = module
    spec.loader.exec_module(module)
    return module


def test_partial_rerun_keeps_other_rows_and_sections(run: ModuleType) -> None:
    new = [HEADER, SEP, "| 8-fill | fill 10M | msg/s | 90 | 14 |",
           "| 8-queued | queued | messages | 10 | 9 |",
           "| 8-rss | rss 10M | MiB | 60 | 9,000 |"]
    text = run.merge_results(OLD, new, "run today.", ["(8-rss) peer run 1: alarm"])
    lines = text.splitlines()
    table = [line for line in lines if line.startswith("| ") and line != HEADER]
    assert [t.split("|")[1].strip() for t in table] == ["a", "8-fill", "8-queued", "8-rss"]
    assert "| a | 16 B | msg/s | 1,000 | 100 |" in table
    assert "| 8-fill | fill 10M | msg/s | 90 | 14 |" in table
    assert "| 8-rss | rss 10M | MiB | 60 | 9,000 |" in table
    assert "Run: yesterday." in lines and "- nproc: 2" in lines
    assert "- 8-fill, 8-queued, 8-rss: run today." in lines
    errors = lines[lines.index("## Errors"):]
    assert "- (a) peer run 2: timed out" in errors
    assert "- (8-fill) peer run 1: blocked" not in errors
    assert "- (8-rss) peer run 1: alarm" in errors
    # a second rerun of the same scenarios replaces the first one's note, keeps one table
    again = run.merge_results(text, new, "run later.", [])
    assert "- 8-fill, 8-queued, 8-rss: run today." not in again
    assert again.count("- 8-fill, 8-queued, 8-rss: run later.") == 1
    assert again.count(HEADER) == 1 and again.count("| a | 16 B |") == 1


def test_other_columns_refuse_to_merge(run: ModuleType) -> None:
    with pytest.raises(ValueError, match="other columns"):
        run.merge_results(OLD, ["| scenario | what | unit | Skred (median) |", "|---|---|---|---|"], "x", [])
