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


def test_a_peer_carried_between_members_keeps_what_external_and_the_api_read() -> None:
    # the form a member sends with a client whose TLS it ended (PROXY v2's PP2_TYPE_SSL TLV)
    peer = tls.PeerTLS("TLSv1.3", "TLS_AES_256_GCM_SHA384", CERT)
    raw = tls.carried(peer)
    assert raw[0] == tls.PP2_TYPE_SSL and int.from_bytes(raw[1:3], "big") == len(raw) - 3
    assert raw[3] == tls.PP2_CLIENT_SSL | tls.PP2_CLIENT_CERT_CONN and raw[4:8] == bytes(4)  # verified
    assert b"\x22\x00\x03app" in raw  # PP2_SUBTYPE_SSL_CN, as HAProxy and others read it
    back = tls.from_carried(raw)
    for source in ("common_name", "subject_alternative_name", "distinguished_name"):
        assert back.login_name(source) == peer.login_name(source), source
    assert back.api_fields() == peer.api_fields()
    # TLS with no client certificate: carried as TLS, no identity
    bare = tls.from_carried(tls.carried(tls.PeerTLS("TLSv1.2", "ECDHE", {})))
    assert bare.cert == {} and bare.login_name("common_name") is None and bare.protocol == "TLSv1.2"


@pytest.mark.parametrize("bad", [
    b"", b"\x20\x00", b"\x21\x00\x05\x01\x00\x00\x00\x00",  # short; not PP2_TYPE_SSL
    b"\x20\x00\x09\x01\x00\x00\x00\x00\x21\x00\x09x",  # a cut sub-TLV
    b"\x20\x00\x05\x00\x00\x00\x00\x00",  # not TLS
    b"\x20\x00\x05\x03\x00\x00\x00\x01",  # a certificate that did not verify
    b"\x20\x00\x05\x03\x00\x00\x00\x00",  # a certificate with no fields
    b"\x20\x00\x0a\x03\x00\x00\x00\x00\xe0\x00\x02{}",  # ... or no subject
    b"\x20\x00\x18\x03\x00\x00\x00\x00\xe0\x00\x10{\"subject\": [7]}",  # names that are not pairs
    b"\x20" + (tls.MAX_CARRIED).to_bytes(2, "big") + bytes(tls.MAX_CARRIED),  # too long
])
def test_a_malformed_carried_peer_is_refused(bad: bytes) -> None:
    with pytest.raises(ValueError):
        tls.from_carried(bad)
