"""skredctl's TLS settings from the environment (SKREDCTL_CACERT, _CERT, _KEY) are defaults for
https:// URLs: a shell set up for an HTTPS broker still runs commands against a plain one, while
the same options given as flags with a plain URL stay a usage error. No broker needed: port 1 on
127.0.0.1 refuses the connection."""

from __future__ import annotations

import pytest

from broker import ctl


def test_environment_tls_files_do_not_break_a_plain_url(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SKREDCTL_CACERT", "/nonexistent/ca.pem")
    monkeypatch.setenv("SKREDCTL_CERT", "/nonexistent/client.pem")
    assert ctl.main(["--url", "http://127.0.0.1:1", "status"]) == 2
    err = capsys.readouterr().err
    assert "cannot connect" in err and "https://" not in err, err


def test_environment_tls_files_apply_to_https(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("SKREDCTL_CACERT", "/nonexistent/ca.pem")
    assert ctl.main(["--url", "https://127.0.0.1:1", "status"]) == 2
    assert "cannot load TLS files" in capsys.readouterr().err


def test_tls_flags_with_a_plain_url_are_a_usage_error(monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("SKREDCTL_CACERT", raising=False)
    assert ctl.main(["--url", "http://127.0.0.1:1", "--cacert", "/nonexistent/ca.pem", "status"]) == 2
    assert "need an https:// --url" in capsys.readouterr().err
