"""Config: precedence defaults < ini < env < flags, value parsing, errors, --help."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from broker import __version__, cli
from broker.config import (
    OPTIONS,
    SECTIONS,
    AmqpConfig,
    ClusteringConfig,
    Config,
    ConfigError,
    MainConfig,
    MgmtConfig,
    build_parser,
    default_data_dir,
    load_config,
)
from broker.errors import DataDirLocked, StoreError


def write_ini(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "skred.ini"
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults_match_the_dataclasses() -> None:
    config = load_config([], environ={})
    assert config.amqp == AmqpConfig()
    assert config.mgmt == MgmtConfig()
    assert config.clustering == ClusteringConfig()
    assert config.main == MainConfig(data_dir=default_data_dir())
    assert config.main.segment_size == 8 * 1024 * 1024
    assert config.main.sync is True
    assert config.amqp.port == 5672
    assert config.clustering.enabled is False


def test_default_data_dir_depends_on_user() -> None:
    expected = (
        Path("/var/lib/skred")
        if hasattr(os, "geteuid") and os.geteuid() == 0
        else Path.home() / ".local/share/skred"
    )
    assert default_data_dir() == expected


def test_precedence_defaults_ini_env_flags(tmp_path: Path) -> None:
    ini = write_ini(
        tmp_path,
        """
[main]
data_dir = /from/ini
sync = no
segment_size = 1MiB
[amqp]
port = 1111
heartbeat = 30
tcp_nodelay = off
[mgmt]
port = 2222
[clustering]
enabled = yes
etcd_prefix = ini-prefix
""",
    )
    argv = ["-c", str(ini)]

    # ini over defaults
    config = load_config(argv, environ={})
    assert config.main.data_dir == Path("/from/ini")
    assert config.main.sync is False
    assert config.main.segment_size == 1024 * 1024
    assert config.amqp.port == 1111
    assert config.amqp.heartbeat == 30
    assert config.amqp.tcp_nodelay is False
    assert config.mgmt.port == 2222
    assert config.clustering.enabled is True
    assert config.clustering.etcd_prefix == "ini-prefix"
    assert config.amqp.frame_max == AmqpConfig().frame_max  # untouched option keeps its default

    # env over ini
    env = {
        "SKRED_MAIN_DATA_DIR": "/from/env",
        "SKRED_MAIN_SYNC": "true",
        "SKRED_AMQP_PORT": "3333",
        "SKRED_CLUSTERING_ENABLED": "0",
    }
    config = load_config(argv, environ=env)
    assert config.main.data_dir == Path("/from/env")
    assert config.main.sync is True
    assert config.amqp.port == 3333
    assert config.clustering.enabled is False
    assert config.amqp.heartbeat == 30  # still from ini
    assert config.mgmt.port == 2222

    # flags over env
    flags = ["--data-dir", "/from/flag", "--no-sync", "--amqp-port", "4444", "--clustering"]
    config = load_config(argv + flags, environ=env)
    assert config.main.data_dir == Path("/from/flag")
    assert config.main.sync is False
    assert config.amqp.port == 4444
    assert config.clustering.enabled is True
    assert config.main.segment_size == 1024 * 1024  # still from ini


def test_env_alone_and_flags_alone() -> None:
    config = load_config([], environ={"SKRED_AMQP_PORT": "5673", "SKRED_MAIN_SYNC": "false"})
    assert config.amqp.port == 5673
    assert config.main.sync is False
    config = load_config(["--sync", "--mgmt-port", "0", "--no-mgmt"], environ={"SKRED_MAIN_SYNC": "off"})
    assert config.main.sync is True
    assert config.mgmt.port == 0
    assert config.mgmt.enabled is False


@pytest.mark.parametrize(
    ("text", "expected"),
    [(t, True) for t in ("true", "TRUE", "yes", "1", "on", " On ")]
    + [(t, False) for t in ("false", "no", "0", "off", "No")],
)
def test_boolean_spellings(text: str, expected: bool) -> None:
    assert load_config([], environ={"SKRED_AMQP_TCP_NODELAY": text}).amqp.tcp_nodelay is expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4096", 4096), ("8MiB", 8 << 20), ("8M", 8 << 20), ("512 KiB", 512 << 10), ("1GiB", 1 << 30),
     ("2MB", 2_000_000)],
)  # fmt: skip
def test_sizes(text: str, expected: int) -> None:
    assert load_config(["--segment-size", text], environ={}).main.segment_size == expected


def test_lists_and_paths() -> None:
    config = load_config(["--amqp-trusted-proxies", "10.0.0.0/8, ::1", "--data-dir", "~/skred-x"], environ={})
    assert config.amqp.trusted_proxies == ("10.0.0.0/8", "::1")
    assert config.main.data_dir == Path.home() / "skred-x"


def test_hook_commands_keep_percent_signs(tmp_path: Path) -> None:
    ini = write_ini(tmp_path, "[clustering]\non_leader_elected = date +%s > /tmp/elected\n")
    config = load_config(["-c", str(ini)], environ={})
    assert config.clustering.on_leader_elected == "date +%s > /tmp/elected"


@pytest.mark.parametrize(
    ("argv", "environ", "fragments"),
    [
        ([], {"SKRED_MAIN_SYNC": "maybe"}, ["main.sync", "SKRED_MAIN_SYNC", "maybe"]),
        ([], {"SKRED_AMQP_PORT": "abc"}, ["amqp.port", "SKRED_AMQP_PORT", "not an integer"]),
        ([], {"SKRED_AMQP_PORT": "70000"}, ["amqp.port", "maximum"]),
        (["--amqp-port", "-2"], {}, ["amqp.port", "--amqp-port", "minimum"]),  # -1: listener off
        (["--segment-size", "8 parsecs"], {}, ["main.segment_size", "--segment-size"]),
        (["--log-level", "loud"], {}, ["main.log_level", "loud"]),
        (["--amqp-trusted-proxies", "not-an-ip"], {}, ["amqp.trusted_proxies", "not-an-ip"]),
    ],
)
def test_bad_values_name_option_and_source(
    argv: list[str], environ: dict[str, str], fragments: list[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(argv, environ=environ)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_bad_ini_value_names_file_and_key(tmp_path: Path) -> None:
    ini = write_ini(tmp_path, "[amqp]\nheartbeat = soon\n")
    with pytest.raises(ConfigError, match=r"amqp\.heartbeat.*\[amqp\] heartbeat in .*skred\.ini"):
        load_config(["-c", str(ini)], environ={})


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("[amqp]\nprot = 1\n", "unknown option 'prot'"),
        ("[amqpp]\nport = 1\n", r"unknown section \[amqpp\]"),
        ("port = 1\n", "not a valid ini file"),
    ],
)
def test_bad_ini_files(tmp_path: Path, text: str, match: str) -> None:
    ini = write_ini(tmp_path, text)
    with pytest.raises(ConfigError, match=match):
        load_config(["-c", str(ini)], environ={})


def test_missing_ini_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(["-c", str(tmp_path / "absent.ini")], environ={})


def test_cli_reports_config_errors_with_exit_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SKRED_MAIN_SYNC", "perhaps")
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert "SKRED_MAIN_SYNC" in err and "perhaps" in err
    assert "Traceback" not in err


def test_unknown_flag_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        load_config(["--no-such-flag"], environ={})
    assert info.value.code == 2
    assert cli.main(["--no-such-flag"]) == 2


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"]) == 0
    assert __version__ in capsys.readouterr().out


def test_help_mentions_every_option() -> None:
    text = " ".join(build_parser().format_help().split())  # undo line wrapping
    assert "-c FILE" in text
    assert "/var/lib/skred as root, else ~/.local/share/skred" in text
    for option in OPTIONS:
        assert option.flag in text, option.key
        assert option.env in text, option.key
        assert f"[{option.section}] {option.name}" in text, option.key
        assert option.help.split()[0] in text, option.key


def test_table_covers_every_dataclass_field() -> None:
    declared = {(o.section, o.name) for o in OPTIONS}
    fields = {(section, f.name) for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    assert declared == fields
    assert {f.name for f in dataclasses.fields(Config)} == set(SECTIONS)
    assert len({o.env for o in OPTIONS}) == len(OPTIONS)
    assert len({o.flag for o in OPTIONS}) == len(OPTIONS)


def test_every_option_round_trips_through_env() -> None:
    # Each option's default, rendered as text the way an operator would write it, parses back to itself.
    for option in OPTIONS:
        if option.default is None:
            continue
        if option.kind == "bool":
            text = "yes" if option.default else "no"
        elif option.kind == "networks":
            text = ",".join(option.default)
        else:
            text = str(option.default)
        config = load_config([], environ={option.env: text})
        assert getattr(getattr(config, option.section), option.name) == option.default, option.key


def test_config_is_frozen() -> None:
    config = load_config([], environ={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.amqp.port = 1  # type: ignore[misc]


@pytest.fixture
def fake_node(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """A stand-in ``broker.node`` whose ``serve`` the test sets; restores root logging after."""
    module = types.ModuleType("broker.node")
    module.StartupError = type("StartupError", (Exception,), {})  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "broker.node", module)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        yield module
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def test_cli_hands_config_to_serve(
    fake_node: types.ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[Config] = []

    def serve(config: Config, host: object = None, load: Callable[[], Config] | None = None) -> int:
        seen.append(config)
        assert load().main.data_dir == tmp_path  # SIGHUP re-reads the same sources
        return 7

    monkeypatch.setattr(fake_node, "serve", serve, raising=False)
    assert cli.main(["--data-dir", str(tmp_path), "--log-level", "debug"]) == 7
    assert seen[0].main.data_dir == tmp_path
    assert logging.getLogger().level == logging.DEBUG


@pytest.mark.parametrize(
    ("error", "fragment"),
    [(DataDirLocked("data directory {} is in use by another process (pid 42)"), "in use by another"),
     (StoreError("bad"), "unusable")],
)
def test_cli_store_errors_exit_1(
    fake_node: types.ModuleType,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    error: Exception,
    fragment: str,
) -> None:
    def serve(config: Config, host: object = None, load: Callable[[], Config] | None = None) -> int:
        raise type(error)(str(error).format(tmp_path))

    monkeypatch.setattr(fake_node, "serve", serve, raising=False)
    assert cli.main(["--data-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert fragment in err and str(tmp_path) in err
    assert "Traceback" not in err
