"""broker/tls.py without sockets: SNI option parsing, peer identity, API fields, bad files."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker import tls
from broker.config import ConfigError, MainConfig, load_config

CERT = {
    "subject": ((("organizationName", "Skred, Inc."),), (("commonName", "app"),)),
    "issuer": ((("commonName", "Skred test CA"),),),
    "notBefore": "Nov 23 00:00:00 2026 GMT",
    "notAfter": "Nov 24 00:00:00 2026 GMT",
    "subjectAltName": (("IP Address", "127.0.0.1"), ("DNS", "app.clients.test")),
}


def test_sni_option_parses_names_and_refuses_junk() -> None:
    got = tls.parse_sni(" a.test=/c/a.crt:/c/a.key , *.b.test=/c/b.pem ,")
    assert got == {"a.test": ("/c/a.crt", "/c/a.key"), "*.b.test": ("/c/b.pem", "")}
    for bad in ("no-equals", "=/c/a.crt:/c/a.key", "a.test="):
        with pytest.raises(ConfigError):
            tls.parse_sni(bad)


def test_login_name_from_cn_san_or_dn() -> None:
    peer = tls.PeerTLS("TLSv1.3", "TLS_AES_256_GCM_SHA384", CERT)
    assert peer.login_name("common_name") == "app"
    assert peer.login_name("subject_alternative_name") == "app.clients.test"
    assert peer.login_name("distinguished_name") == r"CN=app,O=Skred\, Inc."
    assert tls.PeerTLS("TLSv1.3", "x", {}).login_name("common_name") is None  # no verified cert


def test_api_fields_as_rabbitmq_names_them() -> None:
    fields = tls.PeerTLS("TLSv1.2", "ECDHE-ECDSA-AES128-GCM-SHA256", CERT).api_fields()
    assert fields["ssl"] is True and fields["ssl_protocol"] == "tlsv1.2"
    assert fields["peer_cert_issuer"] == "CN=Skred test CA"
    assert fields["peer_cert_validity"].startswith("Nov 23")
    assert set(fields) == set(tls.NO_TLS_FIELDS)


def test_unloadable_files_are_config_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pem"
    bad.write_text("nope")
    with pytest.raises(ConfigError, match="tls_cert"):
        tls.ServerTLS(MainConfig(data_dir=tmp_path, tls_cert=str(bad)))
    with pytest.raises(ConfigError, match="tls_ciphers"):
        tls.ServerTLS(MainConfig(data_dir=tmp_path, tls_cert=str(bad), tls_ciphers="NOT-A-CIPHER"))


def test_tls_options_from_the_environment() -> None:
    env = {"SKRED_MAIN_TLS_CERT": "/etc/skred/tls.crt", "SKRED_AMQP_TLS_PORT": "-1",
           "SKRED_MAIN_TLS_MIN_VERSION": "1.3"}
    config = load_config([], environ=env)
    assert config.main.tls_cert == "/etc/skred/tls.crt" and config.amqp.tls_port == -1
    assert config.main.tls_min_version == "1.3" and config.clustering.tls
    with pytest.raises(ConfigError):
        load_config([], environ={"SKRED_MAIN_TLS_MIN_VERSION": "1.1"})
