"""A memory-mapped per-layer-embedding (PLE) table.

The E2B/E4B PLE table ``embed_tokens_per_layer`` is ``262144 x (layers * 256)``: 4.7 GB for E2B in
bf16, more than the rest of the model. Each token only ever needs its own row, so the table stays in
the checkpoint file and :class:`MappedEmbedding` gathers the rows of the tokens being processed.
Two ways, same values:

* where the backend can wrap host memory without a copy (Metal), the file is memory-mapped and the
  device gathers the rows itself: the lookup needs no host sync, so the decode loop stays pipelined
  (the next step's graph is built while the device computes the current token);
* elsewhere (CPU, CUDA) the host reads the rows with one ``pread`` per run of rows, which needs the
  token ids on the host: the one sync of a decode step, before its graph is built.

Only the rows of the tokens seen are ever read.

It stands in for ``nn.Embedding`` (or ``nn.QuantizedEmbedding`` for an MLX-quantized table) in
:meth:`gemma4_mlx.text.TextModel.per_layer_token_inputs` and returns exactly the same values; it is
not an MLX module, so ``model.parameters()`` and ``load_weights`` never see the table.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..errors import CheckpointError

# The names the table has in the layouts we load: HF multimodal, HF text-only, mlx-vlm / mlx-lm.
PLE_KEYS = [
    "model.language_model.embed_tokens_per_layer.weight",
    "model.embed_tokens_per_layer.weight",
    "language_model.model.embed_tokens_per_layer.weight",
    "language_model.embed_tokens_per_layer.weight",
]

# safetensors dtype -> (numpy dtype of the stored bytes, MLX dtype of the values)
_DTYPES = {
    "BF16": (np.uint16, mx.bfloat16),  # numpy has no bfloat16: read the bits, view them in MLX
    "F16": (np.float16, mx.float16),
    "F32": (np.float32, mx.float32),
    "U32": (np.uint32, mx.uint32),  # packed quantized weights
}

_MAX_HEADER = 100_000_000  # the safetensors format's own limit


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """The JSON header of a safetensors file and the offset where its data starts."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise CheckpointError(f"corrupt or truncated safetensors file {path}: shorter than its 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointError(
                    f"corrupt or truncated safetensors file {path}: header of {n} bytes, file of {size} bytes"
                )
            header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"corrupt safetensors file {path}: its header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"corrupt safetensors file {path}: its header is not a JSON object")
    return header, 8 + n


def wrap_host_memory(buffer: np.ndarray) -> mx.array:
    """``buffer`` as an MLX array without a copy (raises ValueError where the backend cannot)."""
    return mx.asarray(buffer, copy=False)


class _MappedTensor:
    """One 2-D tensor of a safetensors file, read a row at a time with ``os.pread``.

    Reading (rather than memory-mapping) keeps nothing of the file in the process: the rows read
    stay in the OS page cache, not in resident memory, and no page-table clean-up is needed after a
    read (unmapping pages of a multi-GB mapping per token cost milliseconds)."""

    def __init__(self, path: Path, header: dict, data_start: int, key: str):
        info = header.get(key)
        if not isinstance(info, dict):
            raise CheckpointError(f"{path} holds no tensor {key!r}")
        try:
            dtype, shape, (begin, end) = info["dtype"], [int(s) for s in info["shape"]], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"corrupt safetensors file {path}: bad header entry for {key!r}") from None
        if dtype not in _DTYPES:
            raise ValueError(f"{key} in {path} has dtype {dtype}; a mapped table must be one of {sorted(_DTYPES)}")
        if len(shape) != 2:
            raise CheckpointError(f"{key} in {path} has shape {tuple(shape)}; a table must be 2-D")
        self.np_dtype, self.mx_dtype = _DTYPES[dtype]
        self.shape = tuple(shape)
        self.row_bytes = shape[1] * np.dtype(self.np_dtype).itemsize
        nbytes = shape[0] * self.row_bytes
        if end - begin != nbytes or begin < 0:
            raise CheckpointError(
                f"corrupt safetensors file {path}: {key} spans {end - begin} bytes, "
                f"its shape {tuple(shape)} and dtype {dtype} need {nbytes}"
            )
        size = path.stat().st_size
        if data_start + end > size:
            raise CheckpointError(
                f"corrupt or truncated safetensors file {path}: {key} ends at byte {data_start + end}, "
                f"the file has {size}"
            )
        self.path, self.offset = path, data_start + begin
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        self._device = None

    def rows(self, idx: np.ndarray) -> mx.array:
        """The rows ``idx`` (sorted, unique) as an MLX array of the tensor's dtype: one read per run
        of consecutive rows, only they are read."""
        out = np.empty((len(idx), self.shape[1]), self.np_dtype)
        flat = out.reshape(-1).view(np.uint8)
        runs = np.flatnonzero(np.diff(idx) != 1) + 1
        for first, stop in zip(np.concatenate([[0], runs]), np.concatenate([runs, [len(idx)]])):
            n = (stop - first) * self.row_bytes
            data = os.pread(self._fd, n, self.offset + int(idx[first]) * self.row_bytes)
            if len(data) != n:
                raise CheckpointError(f"{self.path} was cut short while reading its per-layer embedding table")
            flat[first * self.row_bytes : first * self.row_bytes + n] = np.frombuffer(data, np.uint8)
        rows = mx.array(out)
        return rows.view(mx.bfloat16) if self.mx_dtype == mx.bfloat16 else rows

    def on_device(self) -> mx.array | None:
        """The whole tensor as an MLX array over the file's pages without a copy, where the backend
        can wrap host memory (Metal); None elsewhere. The mapping starts at a page boundary (as
        wrapping requires) and the tensor is a view into it."""
        if self._device is None:
            try:
                data = wrap_host_memory(np.memmap(self.path, dtype=np.uint8, mode="r"))
            except (ValueError, TypeError, OSError):
                self._device = False
            else:
                flat = data[self.offset : self.offset + self.shape[0] * self.row_bytes]
                self._device = flat.view(self.mx_dtype).reshape(self.shape)
        return self._device if self._device is not False else None

    def close(self, _close=os.close) -> None:  # bound here: at interpreter exit ``os`` may be gone
        if getattr(self, "_fd", None) is not None:
            _close(self._fd)
            self._fd = None

    def __del__(self):
        self.close()


class MappedEmbedding:
    """An embedding table left on disk: ``emb(ids)`` gathers the rows of ``ids`` like ``nn.Embedding``.

    ``path``: the safetensors file; ``key``: the table's name in it (``<key>`` for a plain table;
    for an MLX-quantized table ``<name>.weight`` with ``<name>.scales`` and ``<name>.biases`` beside
    it, in the affine format of ``mx.quantize``, and ``group_size``/``bits`` inferred from the shapes
    when not given). ``others``: the checkpoint's other shards, searched for the scales and biases
    when ``path`` lacks them (sharding by size can split one module's tensors across files).
    ``dtype`` casts the gathered rows of a plain table (as ``load(dtype=...)`` casts loaded weights;
    like there, a quantized table keeps its scales' dtype).

    Where the table cannot be gathered on the device (:attr:`on_device` False), the lookup needs the
    token ids on the host (``np.asarray(ids)``), so it evaluates ``ids``: that one sync is inherent to
    reading from a file; nothing else in it waits on the device.
    """

    def __init__(
        self,
        path: str | Path,
        key: str,
        dtype: mx.Dtype | None = None,
        group_size: int | None = None,
        bits: int | None = None,
        dims: int | None = None,
        others: list[str | Path] = (),
    ):
        self.path = Path(path)
        self.key = key
        if not self.path.is_file():
            raise FileNotFoundError(f"no such safetensors file: {self.path}")
        header, data_start = read_safetensors_header(self.path)
        self.weight = _MappedTensor(self.path, header, data_start, key)
        base = key[: -len(".weight")] if key.endswith(".weight") else None
        headers = {self.path: (header, data_start)}  # each file's header read once

        def find(name: str) -> _MappedTensor | None:
            """``name`` from this file, else from the first of ``others`` that holds it."""
            for f in [self.path, *map(Path, others)]:
                if f not in headers:
                    headers[f] = read_safetensors_header(f)
                h, start = headers[f]
                if name in h:
                    return _MappedTensor(f, h, start, name)
            return None

        scales = find(f"{base}.scales") if base is not None else None
        self.quantized = scales is not None
        if self.quantized:
            self._init_quantized(base, scales, find(f"{base}.biases"), group_size, bits, dims)
        else:
            if self.weight.mx_dtype == mx.uint32:
                raise ValueError(f"{key} in {self.path} is uint32 without scales: not an embedding table")
            if dims is not None and dims != self.weight.shape[1]:
                raise CheckpointError(f"{key} in {self.path} has {self.weight.shape[1]} columns, expected {dims}")
            self.shape = self.weight.shape
            self.dtype = dtype if dtype is not None else self.weight.mx_dtype

    def _init_quantized(self, base: str, scales, biases, group_size, bits, dims) -> None:
        """An MLX affine-quantized table: check the three tensors agree, infer the missing settings."""
        if self.weight.mx_dtype != mx.uint32:
            raise ValueError(f"{self.key} in {self.path} has scales but is not packed uint32")
        if biases is None:
            raise ValueError(f"{base} in {self.path} has no biases: only MLX's affine quantization can be mapped")
        self.scales, self.biases = scales, biases
        rows, packed = self.weight.shape
        groups = scales.shape[1]
        if scales.shape[0] != rows or biases.shape != scales.shape:
            raise CheckpointError(f"{base} in {self.path}: weight, scales and biases do not match in shape")
        if dims is None:
            if bits is not None:
                dims = packed * 32 // bits
            elif group_size is not None:
                dims = groups * group_size
            else:
                raise ValueError(f"{base} is quantized: pass bits, group_size or dims")
        bits = packed * 32 // dims if bits is None else bits
        group_size = dims // groups if group_size is None else group_size
        if packed * 32 != dims * bits or groups * group_size != dims:
            raise CheckpointError(
                f"{base} in {self.path}: packed shape {self.weight.shape} and scales {scales.shape} "
                f"do not fit {dims} dims at {bits} bits, group size {group_size}"
            )
        self.group_size, self.bits = group_size, bits
        self.dtype = scales.mx_dtype
        self.shape = (rows, dims)

    @property
    def nbytes(self) -> int:
        """Bytes the table occupies on disk (all of which stay there)."""
        parts = [self.weight] + ([self.scales, self.biases] if self.quantized else [])
        return sum(int(np.prod(p.shape)) * np.dtype(p.np_dtype).itemsize for p in parts)

    def __call__(self, ids: mx.array) -> mx.array:
        rows = self._gather_on_device(ids)
        return rows if rows is not None else self._read_rows(ids)

    def _gather_on_device(self, ids: mx.array) -> mx.array | None:
        """The rows gathered by the device from the file's pages (no host sync: a decode step's
        graph is built before its token is known), where the backend can wrap the mapping; else None.
        Ids are not range-checked here (that would need them on the host): a prompt's ids are
        checked once at the API boundary and sampled ids come from a head of the same vocabulary."""
        parts = [self.weight] + ([self.scales, self.biases] if self.quantized else [])
        tables = [p.on_device() for p in parts]
        if any(t is None for t in tables):
            return None
        flat = mx.array(ids).reshape(-1)
        if self.quantized:
            w, s, b = (mx.take(t, flat, axis=0) for t in tables)
            rows = mx.dequantize(w, scales=s, biases=b, group_size=self.group_size, bits=self.bits)
        else:
            rows = mx.take(tables[0], flat, axis=0)
            rows = rows if rows.dtype == self.dtype else rows.astype(self.dtype)
        return rows.reshape(*ids.shape, self.shape[1])

    def _read_rows(self, ids: mx.array) -> mx.array:
        # Host sync: the rows to read depend on the ids' values, so they must be evaluated here.
        host = np.asarray(ids)
        if host.size == 0:
            return mx.zeros((*host.shape, self.shape[1]), dtype=self.dtype)
        flat = host.reshape(-1).astype(np.int64)
        lo, hi = int(flat.min()), int(flat.max())
        if lo < 0 or hi >= self.shape[0]:
            raise ValueError(f"token id {hi if hi >= self.shape[0] else lo} is outside the table (0..{self.shape[0] - 1})")
        unique, inverse = np.unique(flat, return_inverse=True)  # sorted: reads walk the file forward
        if self.quantized:
            rows = mx.dequantize(
                self.weight.rows(unique),
                scales=self.scales.rows(unique),
                biases=self.biases.rows(unique),
                group_size=self.group_size,
                bits=self.bits,
            )
        else:
            rows = self.weight.rows(unique)
            if rows.dtype != self.dtype:
                rows = rows.astype(self.dtype)
        if len(unique) != len(flat) or not np.array_equal(unique, flat):
            rows = mx.take(rows, mx.array(inverse.reshape(-1).astype(np.int32)), axis=0)
        return rows.reshape(*host.shape, self.shape[1])

    @property
    def on_device(self) -> bool:
        """True where the table is gathered by the device from the mapped file (no host sync)."""
        parts = [self.weight] + ([self.scales, self.biases] if self.quantized else [])
        return all(p.on_device() is not None for p in parts)

    def __repr__(self) -> str:
        q = f", {self.bits}-bit group {self.group_size}" if self.quantized else ""
        return f"MappedEmbedding({self.path.name}:{self.key}, {self.shape[0]}x{self.shape[1]}, {self.dtype}{q})"


def map_ple_table(
    files: list[Path],
    key_candidates: list[str] = PLE_KEYS,
    dtype: mx.Dtype | None = None,
    group_size: int | None = None,
    bits: int | None = None,
    dims: int | None = None,
) -> MappedEmbedding | None:
    """Map the PLE table of a checkpoint from whichever of ``files`` holds it (None if none does).

    ``key_candidates`` are the table's possible names (``*.weight``); the first found is used.
    """
    files = [Path(f) for f in files]
    for f in files:
        header, _ = read_safetensors_header(f)
        for key in key_candidates:
            if key in header:
                return MappedEmbedding(f, key, dtype=dtype, group_size=group_size, bits=bits, dims=dims, others=files)
    return None


__all__ = ["MappedEmbedding", "map_ple_table", "read_safetensors_header", "PLE_KEYS"]
