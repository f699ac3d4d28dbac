"""Reading a GGUF file: its metadata, its tensor table, and each tensor dequantized to torch.

The header is parsed here with `struct` over an `mmap` rather than with `gguf.GGUFReader`, which
builds one numpy view per array element: for a 49k-token vocabulary plus its merges that costs
seconds, against tens of milliseconds here. Tensor data is never copied until it is dequantized,
and dequantization itself is the `gguf` package's vectorised numpy code (`gguf.quants.dequantize`).

GGUF layout (little-endian): magic "GGUF", u32 version (2 or 3), u64 tensor count, u64 metadata
count, the metadata key/values, the tensor table (name, dims fastest-first, ggml type, offset),
then the tensor data, starting at the next multiple of `general.alignment` (default 32).
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

from eecore.models.errors import CorruptCheckpointError, ModelNotFoundError, UnsupportedModelError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# Fixed-width metadata value types -> struct format character.
_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H", GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i", GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (slowest dimension first); GGUF stores the reverse
    ggml_type: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """A parsed GGUF file. `metadata` maps keys to Python values (arrays become lists)."""

    def __init__(self, path: str):
        self.path = path
        if not os.path.exists(path):
            raise ModelNotFoundError(f"{path}: no such GGUF file")
        if not os.path.isfile(path):
            raise ModelNotFoundError(f"{path}: expected a GGUF file, found a directory or special file")
        size = os.path.getsize(path)
        if size < 24:
            raise CorruptCheckpointError(f"{path}: {size} bytes is too short to be a GGUF file")
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.file_size = size
        try:
            self._parse()
        except struct.error as e:
            raise CorruptCheckpointError(f"{path}: the GGUF header is truncated or malformed ({e})") from e
        except UnicodeDecodeError as e:
            raise CorruptCheckpointError(f"{path}: the GGUF header holds a string that is not UTF-8 ({e})") from e

    # ---- header -------------------------------------------------------------------------------

    def _parse(self) -> None:
        buf = self._map
        if buf[:4] != GGUF_MAGIC:
            raise CorruptCheckpointError(
                f"{self.path}: not a GGUF file (expected the magic bytes b'GGUF', found {bytes(buf[:4])!r})")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in SUPPORTED_VERSIONS:
            hint = " (a big-endian file?)" if version > 0xFFFF else ""
            raise UnsupportedModelError(
                f"{self.path}: GGUF version {version}{hint} is not supported; expected one of {SUPPORTED_VERSIONS}")
        if n_kv > self.file_size or n_tensors > self.file_size:
            raise CorruptCheckpointError(f"{self.path}: implausible GGUF counts ({n_kv} keys, {n_tensors} tensors)")
        self._pos = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._read_string()
            value_type = self._read("<I")
            self.metadata[key] = self._read_value(value_type, key)

        table = []
        for _ in range(n_tensors):
            name = self._read_string()
            n_dims = self._read("<I")
            if n_dims > 8:
                raise CorruptCheckpointError(f"{self.path}: tensor {name!r} claims {n_dims} dimensions")
            dims = struct.unpack_from(f"<{n_dims}Q", buf, self._pos)
            self._pos += 8 * n_dims
            raw_type, offset = struct.unpack_from("<IQ", buf, self._pos)
            self._pos += 12
            table.append((name, dims, raw_type, offset))

        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise CorruptCheckpointError(f"{self.path}: general.alignment {alignment} is not a power of two")
        data_start = -(-self._pos // alignment) * alignment
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, dims, raw_type, offset in table:
            self.tensors[name] = self._tensor_info(name, dims, raw_type, data_start + offset)

    def _tensor_info(self, name: str, dims: tuple[int, ...], raw_type: int, offset: int) -> GGUFTensorInfo:
        try:
            ggml_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise UnsupportedModelError(f"{self.path}: tensor {name!r} has unknown ggml type id {raw_type}") from None
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
        if dims and dims[0] % block_size:
            raise CorruptCheckpointError(
                f"{self.path}: tensor {name!r} row length {dims[0]} is not a multiple of the "
                f"{ggml_type.name} block size {block_size}")
        nbytes = n_elements // block_size * type_size
        if name in self.tensors:
            raise CorruptCheckpointError(f"{self.path}: tensor {name!r} appears twice")
        if offset + nbytes > self.file_size:
            raise CorruptCheckpointError(
                f"{self.path}: tensor {name!r} ends at byte {offset + nbytes} but the file has "
                f"{self.file_size} bytes (truncated download?)")
        return GGUFTensorInfo(name, tuple(int(d) for d in reversed(dims)), ggml_type, offset, nbytes)

    def _read(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _read_string(self) -> str:
        length = self._read("<Q")
        end = self._pos + length
        if end > self.file_size:
            raise struct.error(f"a string of {length} bytes at offset {self._pos} runs past the end of the file")
        text = self._map[self._pos:end].decode("utf-8")
        self._pos = end
        return text

    def _read_value(self, value_type: int, key: str) -> Any:
        if value_type in _SCALAR_FORMATS:
            return self._read("<" + _SCALAR_FORMATS[value_type])
        if value_type == GGUFValueType.STRING:
            return self._read_string()
        if value_type == GGUFValueType.ARRAY:
            item_type, count = struct.unpack_from("<IQ", self._map, self._pos)
            self._pos += 12
            if count > self.file_size:
                raise struct.error(f"array {key!r} claims {count} items")
            if item_type in _SCALAR_FORMATS:
                dtype = np.dtype("<" + _SCALAR_FORMATS[item_type])
                end = self._pos + count * dtype.itemsize
                if end > self.file_size:
                    raise struct.error(f"array {key!r} runs past the end of the file")
                values = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._pos).tolist()
                self._pos = end
                return values
            if item_type == GGUFValueType.STRING:
                return [self._read_string() for _ in range(count)]
            if item_type == GGUFValueType.ARRAY:
                return [self._read_value(GGUFValueType.ARRAY, key) for _ in range(count)]
        raise CorruptCheckpointError(f"{self.path}: metadata {key!r} has unknown value type {value_type}")

    # ---- tensors ------------------------------------------------------------------------------

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as stored, shaped [..., row_bytes] (a zero-copy view of the file)."""
        info = self.tensors[name]
        data = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        block_size, type_size = GGML_QUANT_SIZES[info.ggml_type]
        row_bytes = info.shape[-1] // block_size * type_size if info.shape else info.nbytes
        return data.reshape(*info.shape[:-1], row_bytes)

    def release(self, name: str) -> None:
        """Drop the file pages of tensor `name` from this process's memory once it has been copied:
        a mapped page read once stays resident (and counted in the process's RSS) while the mapping
        lives, so a loader that copies every tensor would otherwise hold the file twice at its peak."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        info = self.tensors[name]
        start = info.offset - info.offset % mmap.PAGESIZE  # a neighbour's edge page is read back if needed
        self._map.madvise(mmap.MADV_DONTNEED, start, info.offset + info.nbytes - start)

    def load_tensor(self, name: str, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """The tensor dequantized to `dtype` (None: as stored for F32/F16/BF16, else float32), in a
        fresh (writable, owned) torch tensor."""
        info = self.tensors[name]
        data = self.raw(name)
        if info.ggml_type == GGMLQuantizationType.F32:
            tensor = torch.from_numpy(data.view(np.float32).copy())
        elif info.ggml_type == GGMLQuantizationType.F16:
            tensor = torch.from_numpy(data.view(np.float16).copy())
        elif info.ggml_type == GGMLQuantizationType.BF16:
            tensor = torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16)
        else:
            try:
                values = dequantize(data, info.ggml_type)
            except NotImplementedError as e:
                raise UnsupportedModelError(
                    f"{self.path}: tensor {name!r} is {info.ggml_type.name}, which the gguf package cannot "
                    f"dequantize ({e})") from e
            tensor = torch.from_numpy(values)
        tensor = tensor.reshape(info.shape)
        return tensor if dtype is None or tensor.dtype == dtype else tensor.to(dtype)
