"""The tensors of a GGUF file, indexed without decoding its metadata: each tensor's name, ggml type,
shape and bytes, memory-mapped copy-on-write.

``gguf.GGUFReader`` also decodes every metadata value, the tokenizer's hundreds of thousands of
strings among them, which dominates a load; a load needs only the tensors, so this index steps over
the metadata by its lengths alone.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.errors import RuntimeUserError

# GGUF metadata value types (gguf.GGUFValueType): byte sizes of the scalars; 8 string, 9 array
SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9
FLOAT_DTYPES = {0: np.float32, 1: np.float16}  # ggml's F32 and F16 tensors, typed
ALIGNMENT_KEY = "general.alignment"


@dataclass(frozen=True)
class GgufTensor:
    name: str
    tensor_type: int  # ggml type id
    shape: tuple[int, ...]  # ggml's order: shape[0] is the length of a row
    data: np.ndarray  # F32/F16: typed, numpy order; other types: uint8 [..., row_bytes]


@dataclass(frozen=True)
class GgufIndex:
    path: Path
    tensors: list[GgufTensor]


def _string(buf: memoryview, off: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, off)
    return bytes(buf[off + 8 : off + 8 + n]).decode("utf-8"), off + 8 + n


def _skip(buf: memoryview, off: int, vtype: int) -> int:
    """The offset after a metadata value of type ``vtype`` starting at ``off``."""
    if vtype in SCALAR_BYTES:
        return off + SCALAR_BYTES[vtype]
    if vtype == STRING:
        return off + 8 + struct.unpack_from("<Q", buf, off)[0]
    if vtype == ARRAY:
        etype, count = struct.unpack_from("<IQ", buf, off)
        off += 12
        if etype in SCALAR_BYTES:
            return off + count * SCALAR_BYTES[etype]
        for _ in range(count):
            off = _skip(buf, off, etype)
        return off
    raise ValueError(f"unknown GGUF value type {vtype}")


def read_index(path: Path) -> GgufIndex:
    """Every tensor of the GGUF file at ``path`` (version 2 or 3, little-endian). A file that is not
    one is one line naming it."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        mm = np.memmap(path, dtype=np.uint8, mode="c")
        buf = memoryview(mm)
        magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
        if magic != b"GGUF" or version not in (2, 3):
            raise ValueError(f"magic {magic!r}, version {version}")
        off, alignment = 24, 32
        for _ in range(n_kv):
            key, off = _string(buf, off)
            (vtype,) = struct.unpack_from("<I", buf, off)
            if key == ALIGNMENT_KEY:
                (alignment,) = struct.unpack_from("<I", buf, off + 4)
            off = _skip(buf, off + 4, vtype)
        infos = []
        for _ in range(n_tensors):
            name, off = _string(buf, off)
            (n_dims,) = struct.unpack_from("<I", buf, off)
            shape = struct.unpack_from(f"<{n_dims}Q", buf, off + 4)
            ttype, offset = struct.unpack_from("<IQ", buf, off + 4 + 8 * n_dims)
            off += 4 + 8 * n_dims + 12
            if GGMLQuantizationType(ttype) not in GGML_QUANT_SIZES:  # (a type id it does not know: ValueError)
                raise ValueError(f"tensor {name} has ggml type {ttype}, of no known block size")
            infos.append((name, ttype, tuple(int(d) for d in shape), offset))
    except (OSError, struct.error, ValueError, UnicodeDecodeError) as exc:
        raise RuntimeUserError(f"{path} is not a GGUF file this runtime reads ({exc})") from exc
    start = -(-off // alignment) * alignment
    tensors = []
    for name, ttype, shape, offset in infos:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
        rows = shape[::-1][:-1]  # numpy order, the row length last
        nbytes = int(np.prod(shape)) // block * size
        raw = mm[start + offset : start + offset + nbytes]
        if raw.shape[0] != nbytes:
            raise RuntimeUserError(f"{path} is truncated: tensor {name} ends past the end of the file")
        data = raw.view(FLOAT_DTYPES[ttype]).reshape(*rows, shape[0]) if ttype in FLOAT_DTYPES \
            else raw.reshape(*rows, shape[0] // block * size)
        tensors.append(GgufTensor(name, ttype, shape, data))
    return GgufIndex(Path(path), tensors)
