"""MurmurHash3 x86_32: the stream clients' partition hash (super streams, broker/model/superstream.py)."""

from __future__ import annotations

import struct
from typing import Final

HASH_SEED: Final = 104729  # the seed the Java and Go stream clients' hash routing uses
_C1: Final = 0xCC9E2D51
_C2: Final = 0x1B873593
_M32: Final = 0xFFFFFFFF


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & _M32


def murmur3_32(data: bytes, seed: int = HASH_SEED) -> int:
    """MurmurHash3 x86_32 of ``data`` (unsigned)."""
    h = seed & _M32
    n = len(data) // 4
    for (k,) in struct.iter_unpack("<I", data[: n * 4]):
        k = _rotl((k * _C1) & _M32, 15) * _C2 & _M32
        h = (_rotl(h ^ k, 13) * 5 + 0xE6546B64) & _M32
    tail = data[n * 4 :]
    k = 0
    for i, b in enumerate(tail):
        k |= b << (8 * i)
    if tail:
        h ^= _rotl((k * _C1) & _M32, 15) * _C2 & _M32
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)
