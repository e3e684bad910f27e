"""Test certificates made with ``cryptography``: a CA, server certificates, client certificates.

``make_pki(dir)`` writes a CA, a server certificate with SANs for localhost and
127.0.0.1-127.0.0.4 (the cluster tests bind members to 127.0.0.2-4), and a
client certificate (CN ``tls-user``); ``issue`` makes more, e.g. a second
server name for SNI or a certificate from another CA that the broker must not
trust. Keys are EC P-256: fast to make, accepted by every OpenSSL.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SERVER_IPS = ("127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4")


@dataclass
class Issued:
    cert: Path
    key: Path


@dataclass
class CA:
    cert_path: Path
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate


@dataclass
class PKI:
    ca: CA
    server: Issued
    client: Issued
    dir: Path

    def client_context(self, *, cert: Issued | None = None, ca: Path | None = None) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(ca or self.ca.cert_path))
        if cert is not None:
            ctx.load_cert_chain(str(cert.cert), str(cert.key))
        return ctx


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Skred tests"),
                      x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))


def make_ca(dir: Path, cn: str = "Skred test CA") -> CA:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=2)
    cert = (
        x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn))
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    dir.mkdir(parents=True, exist_ok=True)
    path = dir / f"{cn.replace(' ', '_')}.crt"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return CA(path, key, cert)


def issue(ca: CA, dir: Path, cn: str, *, dns: tuple[str, ...] = (), ips: tuple[str, ...] = (),
          client: bool = False) -> Issued:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1)
    aki = x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.key.public_key())
    sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
    sans += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    usage = [ExtendedKeyUsageOID.CLIENT_AUTH] if client else [ExtendedKeyUsageOID.SERVER_AUTH,
                                                              ExtendedKeyUsageOID.CLIENT_AUTH]
    builder = (
        x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca.cert.subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        .add_extension(aki, critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca.key, hashes.SHA256())
    stem = cn.replace(" ", "_").replace("*", "star")
    out = Issued(dir / f"{stem}.crt", dir / f"{stem}.key")
    out.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, out.key)
    return out


def make_pki(dir: Path, client_cn: str = "tls-user") -> PKI:
    ca = make_ca(dir)
    server = issue(ca, dir, "localhost", dns=("localhost",), ips=SERVER_IPS)
    client = issue(ca, dir, client_cn, dns=(f"{client_cn}.clients.test",), client=True)
    return PKI(ca, server, client, dir)


def tls_args(pki: PKI, *extra: str) -> list[str]:
    """Broker flags for TLS with this PKI, plus any extra flags."""
    return ["--tls-cert", str(pki.server.cert), "--tls-key", str(pki.server.key),
            "--tls-ca-cert", str(pki.ca.cert_path), *extra]
