"""A small GGUF reader: the key/value metadata and the tensor table in bulk reads of one
read-only memory map; tensor data stays in the map (views, no copy).

Layout read (GGUF versions 2 and 3, little-endian; every integer little-endian):

    magic "GGUF", u32 version, u64 tensor_count, u64 kv_count
    kv_count x   (string key, u32 value type, value)
    tensor_count x (string name, u32 n_dims, u64 dims[n_dims] innermost first, u32 ggml type,
                    u64 offset from the data section)
    padding to `general.alignment` (default 32), then the data section
    string = u64 byte length + UTF-8 bytes; array = u32 item type + u64 count + items

Values come out as Python scalars (int, float from the stored fp32/fp64, bool, str), a
list[str] for an array of strings, and a read-only numpy view of the map for an array of
numbers (its stored dtype, little-endian). A tensor's `data` has gguf-py's dtype and shape
(F32/F16/F64/I8-I64: that dtype, shape reversed; every other type, BF16 included: uint8 bytes,
the innermost dim in bytes), so its bytes are the file's bytes.

Strings arrays (the tokenizer's 49k tokens and 49k merges) are read without a Python step
per string: the starts are the positions whose u64 length prefix has bytes 2..7 zero and
whose first text byte is not NUL (a byte scan), taken as the array's only if they chain
(start[i+1] == start[i] + 8 + len[i], start[0] the array's start: the chain alone proves
them, whatever the scan let through); the texts are the bytes between, joined with the
prefixes' NUL 8th byte as the separator and split once, taken only if that gives exactly n
strings (no string holds a NUL). An array the scan cannot prove
(an empty string, a string of 64 KiB or more, a NUL in a string) is read string by string
(_strings_stepwise), the same result.

No shape legend: byte offsets and counts only.
"""
from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# GGUF value type -> (struct format of a scalar, numpy dtype of an array item); 8 string, 9 array
SCALARS = {0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"),
           5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "?"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"),
           12: ("<d", "<f8")}
STRING, ARRAY = 8, 9
# ggml types gguf-py exposes with their own dtype (element shape); every other type is bytes
TYPED = {"F32": "<f4", "F16": "<f2", "F64": "<f8", "I8": "<i1", "I16": "<i2", "I32": "<i4", "I64": "<i8"}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file: what gguf.ReaderTensor holds (less its raw header parts)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order, innermost first
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file
    data: np.ndarray  # read-only view of the map (dtype and shape: module docstring)


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF: `fields` key -> value (module docstring), `tensors` in file order.
    The map stays open for the object's life (the tensors' data are views of it)."""

    path: str
    version: int
    alignment: int
    data_offset: int
    fields: dict[str, Any]
    tensors: tuple[GGUFTensor, ...]

    def tensor_map(self) -> dict[str, GGUFTensor]:
        return {t.name: t for t in self.tensors}


class _Cursor:
    """Sequential little-endian reads of the map's bytes; ValueError past the end."""

    def __init__(self, buf: mmap.mmap, u8: np.ndarray):
        self.buf, self.u8, self.off = buf, u8, 0

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.off + n > len(self.buf):
            raise ValueError(f"GGUF file truncated: {what} needs {n} bytes at offset {self.off}; "
                             f"the file has {len(self.buf)}")

    def scalar(self, fmt: str, what: str):
        size = struct.calcsize(fmt)
        self.need(size, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.off)
        self.off += size
        return v

    def string(self, what: str) -> str:
        n = self.scalar("<Q", what)
        self.need(n, what)
        raw = self.buf[self.off:self.off + n]
        self.off += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"GGUF {what} must be UTF-8; got {raw[:40]!r}: {e}") from None

    def array(self, dtype: str, n: int, what: str) -> np.ndarray:
        size = np.dtype(dtype).itemsize * n
        self.need(size, what)
        a = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.off)
        self.off += size
        return a


def _chain_ok(starts: np.ndarray, lengths: np.ndarray) -> bool:
    """Whether each start is the previous start + its 8-byte prefix + its length."""
    return bool(np.array_equal(starts[1:], starts[:-1] + 8 + lengths[:-1]))


def _string_starts(u8: np.ndarray, off: int, n: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(starts relative to off [n], lengths [n]) of n strings at `off`, found by the byte scan
    and proved by the chain (module docstring); None where the scan cannot prove them."""
    total = u8.size - off
    width = min(total, 16 * n + 64)
    while True:
        z = u8[off:off + width] == 0
        m = width - 8
        if m <= 0:
            return None
        cand = ~z[8:8 + m]
        for j in range(2, 8):
            cand &= z[j:j + m]
        starts = np.flatnonzero(cand)[:n]
        if starts.size == n or width == total:
            break
        width = min(total, 2 * width)
    if starts.size != n or starts[0] != 0:
        return None
    win = u8[off:off + width]
    lengths = win[starts].astype(np.int64) | (win[starts + 1].astype(np.int64) << 8)
    return (starts, lengths) if _chain_ok(starts, lengths) else None


def _strings_bulk(cur: _Cursor, n: int) -> list[str] | None:
    """n strings at the cursor in bulk reads (cursor moved past them), or None (cursor kept)."""
    if n == 0:
        return []
    found = _string_starts(cur.u8, cur.off, n)
    if found is None:
        return None
    starts, lengths = found
    end = int(starts[-1] + 8 + lengths[-1])
    if cur.off + end > cur.u8.size:
        return None
    keep = np.ones(end, dtype=bool)
    keep[(starts[:, None] + np.arange(7)).ravel()] = False  # each prefix's 8th byte (0) stays: the separator
    strings = _split(cur.u8[cur.off:cur.off + end][keep].tobytes(), n)
    if strings is not None:
        cur.off += end
    return strings


def _split(joined: bytes, n: int) -> list[str] | None:
    """The n strings of `joined` (each preceded by one NUL), or None if it does not hold
    exactly n NULs (a string holds one) or is not UTF-8."""
    try:
        parts = joined.decode("utf-8").split("\x00")
    except UnicodeDecodeError:
        return None
    return parts[1:] if len(parts) == n + 1 else None


def _strings_stepwise(cur: _Cursor, n: int, what: str) -> list[str]:
    """n strings at the cursor, one at a time (the general path)."""
    return [cur.string(f"{what}[{i}]") for i in range(n)]


def _value(cur: _Cursor, vtype: int, what: str):
    """One value of GGUF type vtype at the cursor (module docstring's representation)."""
    if vtype == STRING:
        return cur.string(what)
    if vtype in SCALARS:
        return cur.scalar(SCALARS[vtype][0], what)
    if vtype != ARRAY:
        raise ValueError(f"GGUF {what}: value type must be one of 0-12; got {vtype}")
    itype, n = cur.scalar("<I", what), cur.scalar("<Q", what)
    if itype == STRING:
        cur.need(8 * n, f"{what}'s {n} strings")  # each at least its length prefix
        return _strings_bulk(cur, n) or _strings_stepwise(cur, n, what)
    if itype not in SCALARS:
        raise ValueError(f"GGUF {what}: array item type must be a number or a string; got {itype}")
    return cur.array(SCALARS[itype][1], n, what)


def _fields(cur: _Cursor, count: int) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for i in range(count):
        key = cur.string(f"metadata key {i}")
        if key in fields:
            raise ValueError(f"GGUF metadata key {key!r} appears twice")
        fields[key] = _value(cur, cur.scalar("<I", key), key)
    return fields


def _tensor(u8: np.ndarray, cur: _Cursor, data_offset: int, info) -> GGUFTensor:
    """The tensor of one table entry (name, dims, ggml type, offset), its data a map view."""
    import gguf

    name, dims, raw_type, rel = info
    try:
        ttype = gguf.GGMLQuantizationType(raw_type)
    except ValueError:
        raise ValueError(f"GGUF tensor {name!r}: unknown ggml type {raw_type}") from None
    block, type_size = gguf.GGML_QUANT_SIZES[ttype]
    n_el = math.prod(dims)
    n_bytes = n_el * type_size // block
    start = data_offset + rel
    if start + n_bytes > u8.size:
        raise ValueError(f"GGUF tensor {name!r}: data [{start}, {start + n_bytes}) past the file's "
                         f"{u8.size} bytes")
    shape = tuple(reversed(dims))
    if ttype.name in TYPED:
        data = np.frombuffer(cur.buf, dtype=TYPED[ttype.name], count=n_el, offset=start).reshape(shape)
    else:
        if shape and shape[-1] % block:
            raise ValueError(f"GGUF tensor {name!r}: rows of {shape[-1]} are not whole {ttype.name} blocks of {block}")
        byte_shape = (*shape[:-1], shape[-1] // block * type_size) if shape else (n_bytes,)
        data = u8[start:start + n_bytes].reshape(byte_shape)
    return GGUFTensor(name=name, tensor_type=ttype, shape=tuple(dims), n_elements=n_el, n_bytes=n_bytes,
                      data_offset=start, data=data)


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse the GGUF at `path` (mapped read-only, once). ValueError naming what is wrong for
    a file that is not GGUF v2/v3 little-endian, is truncated, or repeats a key or a tensor."""
    with open(path, "rb") as f:
        size = Path(path).stat().st_size
        if size < 24:
            raise ValueError(f"{path}: not a GGUF file (it has {size} bytes; the header alone is 24)")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    u8 = np.frombuffer(buf, dtype=np.uint8)
    cur = _Cursor(buf, u8)
    if buf[:4] != MAGIC:
        raise ValueError(f"{path}: not a GGUF file (magic must be {MAGIC!r}; got {buf[:4]!r})")
    cur.off = 4
    version = cur.scalar("<I", "version")
    if version not in VERSIONS:
        raise ValueError(f"{path}: GGUF version must be one of {VERSIONS} (little-endian); got {version}")
    n_tensors, n_kv = cur.scalar("<Q", "tensor count"), cur.scalar("<Q", "metadata count")
    fields = _fields(cur, n_kv)
    infos, names = [], set()
    for i in range(n_tensors):
        name = cur.string(f"tensor name {i}")
        if name in names:
            raise ValueError(f"GGUF tensor {name!r} appears twice")
        names.add(name)
        n_dims = cur.scalar("<I", name)
        dims = [int(d) for d in cur.array("<u8", n_dims, name)]
        infos.append((name, dims, cur.scalar("<I", name), cur.scalar("<Q", name)))
    align = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise ValueError(f"GGUF general.alignment must be a power of two; got {align!r}")
    data_offset = -(-cur.off // align) * align
    tensors = tuple(_tensor(u8, cur, data_offset, info) for info in infos)
    return GGUFFile(path=str(path), version=version, alignment=align, data_offset=data_offset,
                    fields=fields, tensors=tensors)
