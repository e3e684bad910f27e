"""Password hashes compatible with RabbitMQ's ``rabbit_password_hashing_sha256``.

Theory of operation
-------------------
RabbitMQ stores ``base64(salt || sha256(salt || utf8(password)))`` with a
4-byte random salt. Using the same scheme means user definitions exported from
RabbitMQ (``password_hash`` plus ``hashing_algorithm``) import unchanged, and
ours import into RabbitMQ. Checking re-derives the digest with the stored salt
and compares in constant time so the comparison leaks no timing information.
Hashes made by RabbitMQ's other two schemes (SHA-512, and MD5 from before 3.6)
are checked too when their algorithm name is given, so imported users can log
in; new hashes are always SHA-256, RabbitMQ's default.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets

HASHING_ALGORITHM = "rabbit_password_hashing_sha256"
SALT_SIZE = 4  # RabbitMQ's salt length; changing it breaks compatibility.
# RabbitMQ's hashing module names and the digest each one uses.
ALGORITHMS = {
    HASHING_ALGORITHM: "sha256",
    "rabbit_password_hashing_sha512": "sha512",
    "rabbit_password_hashing_md5": "md5",
}


def _digest(salt: bytes, password: str, digest: str = "sha256") -> bytes:
    return hashlib.new(digest, salt + password.encode("utf-8")).digest()


def hash_password(password: str, salt: bytes | None = None) -> str:
    """A new hash of ``password``; ``salt`` (4 bytes) is random unless given (tests)."""
    if salt is None:
        salt = secrets.token_bytes(SALT_SIZE)
    elif len(salt) != SALT_SIZE:
        raise ValueError(f"salt must be {SALT_SIZE} bytes")
    return base64.b64encode(salt + _digest(salt, password)).decode("ascii")


def check_password(password: str, password_hash: str, algorithm: str = HASHING_ALGORITHM) -> bool:
    """True when ``password`` matches ``password_hash``; False for a malformed hash.

    ``algorithm`` is RabbitMQ's name for the scheme (``hashing_algorithm`` in its
    definitions); an unknown one never matches.
    """
    digest = ALGORITHMS.get(algorithm)
    if digest is None:
        return False
    try:
        raw = base64.b64decode(password_hash.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        return False
    if len(raw) != SALT_SIZE + hashlib.new(digest).digest_size:
        return False
    salt, expected = raw[:SALT_SIZE], raw[SALT_SIZE:]
    return hmac.compare_digest(_digest(salt, password, digest), expected)
