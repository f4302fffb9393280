"""A minimal MessagePack decoder: enough to read wordfreq's word lists without adding a
dependency (nil, bool, ints, floats, str, bin, array, map)."""

from __future__ import annotations

import struct
from typing import Any

__all__ = ["unpack"]


def unpack(data: bytes) -> Any:
    value, end = _read(data, 0)
    if end != len(data):
        raise ValueError(f"trailing bytes after msgpack value at {end}")
    return value


def _read(b: bytes, i: int) -> tuple[Any, int]:  # noqa: C901 - one branch per type tag
    t = b[i]
    i += 1
    if t <= 0x7F:
        return t, i
    if t >= 0xE0:
        return t - 0x100, i
    if 0xA0 <= t <= 0xBF:
        n = t & 0x1F
        return b[i : i + n].decode("utf-8"), i + n
    if 0x90 <= t <= 0x9F:
        return _array(b, i, t & 0x0F)
    if 0x80 <= t <= 0x8F:
        return _map(b, i, t & 0x0F)
    fixed = {0xC0: None, 0xC2: False, 0xC3: True}
    if t in fixed:
        return fixed[t], i
    ints = {
        0xCC: ">B",
        0xCD: ">H",
        0xCE: ">I",
        0xCF: ">Q",
        0xD0: ">b",
        0xD1: ">h",
        0xD2: ">i",
        0xD3: ">q",
        0xCA: ">f",
        0xCB: ">d",
    }
    if t in ints:
        fmt = ints[t]
        size = struct.calcsize(fmt)
        return struct.unpack_from(fmt, b, i)[0], i + size
    sized = {
        0xD9: (">B", "str"),
        0xDA: (">H", "str"),
        0xDB: (">I", "str"),
        0xC4: (">B", "bin"),
        0xC5: (">H", "bin"),
        0xC6: (">I", "bin"),
        0xDC: (">H", "array"),
        0xDD: (">I", "array"),
        0xDE: (">H", "map"),
        0xDF: (">I", "map"),
    }
    if t in sized:
        fmt, kind = sized[t]
        (n,) = struct.unpack_from(fmt, b, i)
        i += struct.calcsize(fmt)
        if kind == "str":
            return b[i : i + n].decode("utf-8"), i + n
        if kind == "bin":
            return bytes(b[i : i + n]), i + n
        return _array(b, i, n) if kind == "array" else _map(b, i, n)
    raise ValueError(f"unsupported msgpack type 0x{t:02x} at {i - 1}")


def _array(b: bytes, i: int, n: int) -> tuple[list[Any], int]:
    out = []
    for _ in range(n):
        v, i = _read(b, i)
        out.append(v)
    return out, i


def _map(b: bytes, i: int, n: int) -> tuple[dict[Any, Any], int]:
    out = {}
    for _ in range(n):
        k, i = _read(b, i)
        v, i = _read(b, i)
        out[k] = v
    return out, i
