"""A minimal GGUF v3 writer for tests, independent of the `gguf` package the reader uses: metadata
of every scalar type, strings, arrays, and tensors in F32, F16, Q8_0 and Q4_1 (quantised here with
the formats' own rules) and Q4_0 (quantised by `gguf.quants.quantize`, decoded here). Each tensor
comes with the float32 values a correct reader must decode, computed here from the block values."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

TYPE_IDS = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 8}


def _string(s: str) -> bytes:
    raw = s.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


class UInt32(int):
    """A metadata integer written as UINT32 (`general.alignment` must be)."""


def _value(v) -> tuple[int, bytes]:
    if isinstance(v, UInt32):
        return 4, struct.pack("<I", v)
    if isinstance(v, bool):
        return 7, struct.pack("<B", v)
    if isinstance(v, int):
        return (5, struct.pack("<i", v)) if -2**31 <= v < 2**31 else (11, struct.pack("<q", v))
    if isinstance(v, float):
        return 6, struct.pack("<f", v)
    if isinstance(v, str):
        return 8, _string(v)
    if isinstance(v, np.ndarray):
        code = {np.dtype("int32"): 5, np.dtype("float32"): 6, np.dtype("uint8"): 0}[v.dtype]
        return 9, struct.pack("<IQ", code, v.size) + v.astype(v.dtype.newbyteorder("<")).tobytes()
    if isinstance(v, list):
        item_type, _ = _value(v[0])
        return 9, struct.pack("<IQ", item_type, len(v)) + b"".join(_value(x)[1] for x in v)
    raise TypeError(type(v))


def quantize_q8_0(x: np.ndarray) -> tuple[bytes, np.ndarray]:
    """(bytes, the values they decode to) for float32 `x` (size a multiple of 32)."""
    blocks = x.reshape(-1, 32).astype(np.float32)
    d = (np.abs(blocks).max(axis=1) / 127).astype(np.float16)
    safe = np.where(d == 0, 1, d.astype(np.float32))
    q = np.clip(np.round(blocks / safe[:, None]), -127, 127).astype(np.int8)
    raw = b"".join(d[i].tobytes() + q[i].tobytes() for i in range(len(blocks)))
    return raw, (d.astype(np.float32)[:, None] * q).reshape(x.shape)


def quantize_q4_1(x: np.ndarray) -> tuple[bytes, np.ndarray]:
    blocks = x.reshape(-1, 32).astype(np.float32)
    lo, hi = blocks.min(axis=1), blocks.max(axis=1)
    d = ((hi - lo) / 15).astype(np.float16)
    m = lo.astype(np.float16)
    safe = np.where(d == 0, 1, d.astype(np.float32))
    q = np.clip(np.round((blocks - m.astype(np.float32)[:, None]) / safe[:, None]), 0, 15).astype(np.uint8)
    packed = q[:, :16] | (q[:, 16:] << 4)
    raw = b"".join(d[i].tobytes() + m[i].tobytes() + packed[i].tobytes() for i in range(len(blocks)))
    return raw, (d.astype(np.float32)[:, None] * q + m.astype(np.float32)[:, None]).reshape(x.shape)


def quantize_q4_0(x: np.ndarray) -> tuple[bytes, np.ndarray]:
    """Blocks of an f16 scale d and 16 bytes, byte j holding elements j (low nibble) and j + 16:
    element = d * (nibble - 8). Quantised by llama.cpp's own rule (`gguf.quants`)."""
    import gguf

    raw = gguf.quants.quantize(x.reshape(-1, 32).astype(np.float32), gguf.GGMLQuantizationType.Q4_0)
    d = raw[:, :2].copy().view("<f2").astype(np.float32)
    qs = raw[:, 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32) - 8
    return raw.tobytes(), (d * q).reshape(x.shape)


def encode_tensor(x: np.ndarray, kind: str) -> tuple[bytes, np.ndarray]:
    if kind == "F32":
        return x.astype("<f4").tobytes(), x.astype(np.float32)
    if kind == "F16":
        h = x.astype("<f2")
        return h.tobytes(), h.astype(np.float32)
    return {"Q8_0": quantize_q8_0, "Q4_1": quantize_q4_1, "Q4_0": quantize_q4_0}[kind](x)


def write_gguf(path: Path, metadata: dict, tensors: dict[str, tuple[np.ndarray, str]],
               alignment: int = 32) -> dict[str, np.ndarray]:
    """Write the file; return, per tensor, the float32 values a correct reader must decode."""
    header = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata) + 1)
    for key, v in {**metadata, "general.alignment": UInt32(alignment)}.items():
        code, payload = _value(v)
        header += _string(key) + struct.pack("<I", code) + payload
    blobs, expected, offset, infos = [], {}, 0, b""
    for name, (x, kind) in tensors.items():
        raw, decoded = encode_tensor(x, kind)
        expected[name] = decoded
        dims = tuple(reversed(x.shape))
        infos += _string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        infos += struct.pack("<IQ", TYPE_IDS[kind], offset)
        pad = -len(raw) % alignment
        blobs.append(raw + b"\0" * pad)
        offset += len(raw) + pad
    head = header + infos
    head += b"\0" * (-len(head) % alignment)
    Path(path).write_bytes(head + b"".join(blobs))
    return expected
