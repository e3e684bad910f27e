"""Issue 27: every way of setting ``[main] workers`` names the same number of workers.

A benchmark run with ``SKRED_WORKERS=1`` in its environment started two workers: the variable of
``[main] workers`` is ``SKRED_MAIN_WORKERS`` (the flag is ``--workers``), and a ``SKRED_`` variable
that named no option was silently ignored, so the default (one per core) applied. A variable that
spells a ``[main]`` option the way its flag does is now refused at start, naming the right one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from broker.config import ConfigError, load_config
from broker.shards.supervisor import worker_count
from tests.integration._support import listener_ports_env

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("argv", "environ", "expected"), [
    ([], {"SKRED_MAIN_WORKERS": "1"}, 1),
    (["--workers", "1"], {"SKRED_MAIN_WORKERS": "3"}, 1),
    (["--workers", "2"], {}, 2),
])
def test_every_source_names_the_same_count(argv: list[str], environ: dict[str, str], expected: int,
                                           tmp_path: Path) -> None:
    ini = tmp_path / "skred.ini"
    ini.write_text("[main]\nworkers = 4\n")
    assert worker_count(load_config(argv, environ=environ)) == expected
    config = load_config(["-c", str(ini), *argv], environ=environ)
    assert worker_count(config) == expected if (argv or environ) else 4


@pytest.mark.parametrize("name", ["SKRED_WORKERS", "SKRED_SYNC", "SKRED_DATA_DIR"])
def test_a_main_option_spelled_like_its_flag_is_refused(name: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config([], environ={name: "1"})
    right = "SKRED_MAIN_" + name.removeprefix("SKRED_")
    assert name in str(err.value) and right in str(err.value)


def test_other_skred_variables_are_left_alone() -> None:
    # the hooks' variables, the test suite's switches and the deploy files' own settings
    env = {"SKRED_NODE_ID": "a", "SKRED_ROLE": "leader", "SKRED_SHARD": "v", "SKRED_HELM": "1",
           "SKRED_SHARD_LEADERS": "true", "SKRED_MAIN_WORKERS": "1",
           "SKRED_DEFAULT_USER": "admin", "SKRED_TLS_CERT": "/etc/skred/tls/tls.crt"}  # compose's
    assert load_config([], environ=env).main.workers == 1


def test_skred_refuses_to_start_with_the_misspelt_variable(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKRED_")}
    env.update(listener_ports_env(), SKRED_WORKERS="1", PYTHONPATH=str(REPO_ROOT))
    try:  # before the fix this broker started (with one worker per core) and served on
        proc = subprocess.run([sys.executable, "-m", "broker", "--data-dir", str(tmp_path / "d")],
                              env=env, capture_output=True, text=True, timeout=20, cwd=REPO_ROOT)
    except subprocess.TimeoutExpired:
        pytest.fail("skred started with SKRED_WORKERS set instead of refusing it")
    assert proc.returncode == 2, proc.stderr
    assert "SKRED_MAIN_WORKERS" in proc.stderr
