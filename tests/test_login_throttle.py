"""Login throttling per source address (broker/auth/throttle.py), with a fake clock."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from broker.auth.throttle import LoginThrottle


def attempt(t: LoginThrottle, ip: str, now: float) -> float | None:
    """One failed login as the listeners run it: admit, (wait), check, fail."""
    wait = t.admit(ip, now)
    if wait is not None:
        t.failed(ip, now + wait)
    return wait


def test_first_failures_are_free_then_the_delay_grows_and_is_bounded() -> None:
    t = LoginThrottle(free=3, base=0.1, max_interval=1.0, max_wait=4.0, quiet=60.0)
    now = 100.0
    for _ in range(3):
        assert attempt(t, "10.0.0.1", now) == 0.0
    waits = []
    for _ in range(8):
        wait = t.admit("10.0.0.1", now)
        assert wait is not None
        waits.append(wait)
        now += wait  # the attempt is checked after its wait, and fails
        t.failed("10.0.0.1", now)
    # sequential attempts: each waits the interval its failure count earned, doubling to the cap
    assert waits == pytest.approx([0.0, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0])
    assert t.delayed == 7 and t.delay_seconds == pytest.approx(4.5)


def test_parallel_attempts_get_successive_slots_and_the_excess_is_refused_unchecked() -> None:
    t = LoginThrottle(free=1, base=1.0, max_interval=1.0, max_wait=3.0, quiet=60.0)
    attempt(t, "10.0.0.1", 0.0)
    waits = [t.admit("10.0.0.1", 0.0) for _ in range(6)]
    # one check per interval, however many connections wait: 0, 1, 2, 3, then refused
    assert waits == [0.0, 1.0, 2.0, 3.0, None, None]
    assert t.refused == 2


def test_other_sources_are_never_delayed() -> None:
    t = LoginThrottle(free=1, base=1.0, max_interval=5.0, max_wait=8.0, quiet=60.0)
    for i in range(10):
        attempt(t, "10.0.0.1", float(i))
    assert t.admit("10.0.0.1", 10.0) != 0.0
    assert t.admit("10.0.0.2", 10.0) == 0.0
    assert t.admit("::1", 10.0) == 0.0


def test_failures_are_forgotten_after_a_quiet_period() -> None:
    t = LoginThrottle(free=1, base=1.0, max_interval=5.0, max_wait=8.0, quiet=30.0)
    for i in range(5):
        attempt(t, "10.0.0.1", float(i))
    assert t.admit("10.0.0.1", 10.0) != 0.0
    t.failed("10.0.0.1", 10.0)
    assert t.admit("10.0.0.1", 10.0 + 31.0) == 0.0
    t.succeeded("10.0.0.1")
    assert t.sources() == 0


def test_successful_logins_are_not_counted_against_the_source() -> None:
    t = LoginThrottle(free=2, base=1.0, max_interval=5.0, max_wait=8.0, quiet=30.0)
    for i in range(100):  # e.g. an HTTP client authenticating every request
        assert t.admit("10.0.0.1", i * 0.001) == 0.0
        t.succeeded("10.0.0.1")
    assert t.sources() == 0


def test_one_log_line_per_burst_and_no_password(caplog: pytest.LogCaptureFixture) -> None:
    t = LoginThrottle(free=2, base=0.1, max_interval=1.0, max_wait=4.0, quiet=10.0)
    caplog.set_level(logging.INFO, logger="broker.auth.throttle")
    for i in range(50):
        t.admit("10.0.0.9", i * 0.01)
        t.failed("10.0.0.9", i * 0.01)
    starts = [r for r in caplog.records if "slowing down" in r.getMessage()]
    assert len(starts) == 1
    t.admit("10.0.0.9", 100.0)  # the burst is over: one summary line
    assert not [r for r in caplog.records if "password" in r.getMessage().lower()]
    ends = [r for r in caplog.records if "ended" in r.getMessage()]
    assert len(ends) == 1 and "50 failed logins" in ends[0].getMessage()


def test_table_is_bounded() -> None:
    t = LoginThrottle(free=1, base=1.0, max_interval=1.0, max_wait=2.0, quiet=60.0, max_sources=100)
    for i in range(1000):
        attempt(t, f"10.0.{i // 256}.{i % 256}", 1.0)
    assert t.sources() <= 100


def test_limits_come_from_the_options(tmp_path: Path) -> None:
    from broker.config import load_config
    from broker.node import login_throttle

    ini = tmp_path / "skred.ini"
    ini.write_text("[main]\nlogin_throttle_free = 2\nlogin_throttle_max_wait = 3000\n")
    cfg = load_config(["-c", str(ini), "--data-dir", str(tmp_path), "--login-throttle-delay", "250"],
                      {"SKRED_MAIN_LOGIN_THROTTLE_MAX_DELAY": "750",
                       "SKRED_MAIN_LOGIN_THROTTLE_FORGET": "30"})
    t = login_throttle(cfg.main)
    assert (t.free, t.base, t.max_interval, t.max_wait, t.quiet) == (2, 0.25, 0.75, 3.0, 30)
    assert [t.interval(n) for n in (2, 3, 4, 5)] == [0.0, 0.25, 0.5, 0.75]
