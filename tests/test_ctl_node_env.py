"""skredctl's defaults where it runs next to a node (its container's health command): SKREDCTL_*
first, then the node's own SKRED_MAIN_DEFAULT_USER/PASSWORD and SKRED_MGMT_PORT, then guest on
15672; flags beat all. ``aliveness`` fails with exit 1 only (a healthcheck's 2 is reserved).
No broker needed: port 1 on 127.0.0.1 refuses the connection."""

from __future__ import annotations

import pytest

from broker import ctl

NAMES = ("SKREDCTL_URL", "SKREDCTL_USER", "SKREDCTL_PASSWORD", "SKRED_MAIN_DEFAULT_USER",
         "SKRED_MAIN_DEFAULT_PASSWORD", "SKRED_MGMT_PORT")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def parsed(*argv: str) -> tuple[str, str, str]:
    args = ctl.build_parser().parse_args([*argv, "aliveness"])
    return args.url, args.user, args.password


def test_nothing_set_means_guest_on_15672(clean_env: pytest.MonkeyPatch) -> None:
    assert parsed() == ("http://127.0.0.1:15672", "guest", "guest")


def test_the_nodes_settings_are_the_next_defaults(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("SKRED_MAIN_DEFAULT_USER", "node-admin")
    clean_env.setenv("SKRED_MAIN_DEFAULT_PASSWORD", "node-secret")
    clean_env.setenv("SKRED_MGMT_PORT", "25672")
    assert parsed() == ("http://127.0.0.1:25672", "node-admin", "node-secret")
    clean_env.setenv("SKREDCTL_URL", "http://127.0.0.1:35672")
    clean_env.setenv("SKREDCTL_USER", "ctl-user")
    clean_env.setenv("SKREDCTL_PASSWORD", "ctl-secret")
    assert parsed() == ("http://127.0.0.1:35672", "ctl-user", "ctl-secret")
    assert parsed("--url", "http://[::1]:1", "-u", "u", "-p", "p") == ("http://[::1]:1", "u", "p")


def test_aliveness_against_nothing_exits_1(clean_env: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert ctl.main(["--url", "http://127.0.0.1:1", "aliveness"]) == ctl.UNHEALTHY == 1
    assert "cannot connect" in capsys.readouterr().err
    assert ctl.main(["--url", "http://127.0.0.1:1", "status"]) == 2  # other commands keep 2
