"""Per-token arrays as compact little-endian binary: int32 ids and versions, float32 logprobs."""

from __future__ import annotations

import sys
from array import array

_LITTLE = sys.byteorder == "little"


def _pack(kind: str, values: list) -> bytes:
    packed = array(kind, values)
    if not _LITTLE:
        packed.byteswap()
    return packed.tobytes()


def _unpack(kind: str, data: bytes | None) -> list:
    if not data:
        return []
    values = array(kind)
    values.frombytes(data)
    if not _LITTLE:
        values.byteswap()
    return values.tolist()


def pack_ints(values: list[int]) -> bytes:
    return _pack("i", values)


def unpack_ints(data: bytes | None) -> list[int]:
    return _unpack("i", data)


def pack_floats(values: list[float]) -> bytes:
    return _pack("f", values)


def unpack_floats(data: bytes | None) -> list[float]:
    return _unpack("f", data)
