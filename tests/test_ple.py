"""The memory-mapped per-layer-embedding table (gemma4_mlx.ple) and ``load(lazy_ple=...)``."""

import json
import os
import struct

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
import torch
from mlx.utils import tree_flatten

from helpers import random_ids

import gemma4_mlx
from checkpoints import build_hf_model, save_checkpoint
from gemma4_mlx.loading.ple import MappedEmbedding, map_ple_table

PLE = "embed_tokens_per_layer"


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def e2b_checkpoint(request, tmp_path_factory):
    dtype = torch.bfloat16 if request.param == "bfloat16" else None
    hf = build_hf_model("e2b")
    return save_checkpoint(hf, tmp_path_factory.mktemp(f"e2b_{request.param}"), dtype=dtype)


def _ple_params(model):
    return [k for k, _ in tree_flatten(model.parameters()) if PLE in k]


@pytest.mark.parametrize("dtype", [None, "float32", "bfloat16"])
def test_lazy_ple_logits_identical(e2b_checkpoint, dtype):
    lazy, _ = gemma4_mlx.load(e2b_checkpoint, dtype=dtype)
    full, _ = gemma4_mlx.load(e2b_checkpoint, dtype=dtype, lazy_ple=False)
    assert _ple_params(lazy) == [] and _ple_params(full) == [f"language_model.{PLE}.weight"]
    assert isinstance(lazy.language_model.mapped_ple, MappedEmbedding)
    ids = mx.array(np.concatenate([random_ids(24, seed=1), random_ids(24, seed=2)]))
    a, b = lazy(ids), full(ids)
    assert a.dtype == b.dtype
    assert mx.array_equal(a, b).item()
    # decode through the cache, one token at a time, with lazy (not yet evaluated) ids
    ca, cb = lazy.make_cache(), full.make_cache()
    for t in range(6):
        tok = ids[:1, t : t + 1] + 0  # a lazy array, as the sampler's tokens are
        assert mx.array_equal(lazy(tok, cache=ca), full(tok, cache=cb)).item()


def test_lazy_ple_greedy_generation_identical(e2b_checkpoint):
    lazy, processor = gemma4_mlx.load(e2b_checkpoint)
    full, _ = gemma4_mlx.load(e2b_checkpoint, lazy_ple=False)
    prompt = random_ids(10, seed=5)[0].tolist()
    ours = [c.token for c in gemma4_mlx.stream_generate(lazy, processor, prompt, max_tokens=24)]
    ref = [c.token for c in gemma4_mlx.stream_generate(full, processor, prompt, max_tokens=24)]
    assert len(ours) > 0 and ours == ref


def test_map_ple_table_finds_each_layout(tmp_path):
    table = np.random.default_rng(0).standard_normal((32, 16)).astype(np.float32)
    for key in ["model.language_model.", "model.", "language_model.", "language_model.model."]:
        f = tmp_path / "model-00002.safetensors"
        mx.save_safetensors(str(f), {key + f"{PLE}.weight": mx.array(table), "other": mx.zeros((2,))})
        other = tmp_path / "model-00001.safetensors"
        mx.save_safetensors(str(other), {"x": mx.zeros((3,))})
        keys = [f"model.language_model.{PLE}.weight", f"model.{PLE}.weight",
                f"language_model.{PLE}.weight", f"language_model.model.{PLE}.weight"]  # fmt: skip
        mapped = map_ple_table([other, f], keys)
        assert mapped is not None and mapped.key == key + f"{PLE}.weight"
        ids = mx.array([[3, 1, 3, 31]])
        assert np.array_equal(np.array(mapped(ids)), table[[3, 1, 3, 31]][None])
    assert map_ple_table([other], keys) is None


def _vm_rss_kb() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def _bf16_bits(rows: np.ndarray, cols: int) -> np.ndarray:
    """Deterministic, finite bf16 bit patterns for the given row indices."""
    j = np.arange(cols, dtype=np.uint32)
    return (0x3C00 + ((rows[:, None].astype(np.uint32) * 2654435761 + j * 40503) % 0x0C00)).astype(np.uint16)


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="measures resident memory through Linux's /proc (macOS has no /proc)")
def test_large_table_stays_on_disk(tmp_path):
    rows, cols, key = 65536, 4096, f"model.language_model.{PLE}.weight"
    nbytes = rows * cols * 2  # 512 MiB
    header = json.dumps({key: {"dtype": "BF16", "shape": [rows, cols], "data_offsets": [0, nbytes]}}).encode()
    header += b" " * (-len(header) % 8)
    path = tmp_path / "ple.safetensors"
    try:
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(header)) + header)
            step = 4096
            for start in range(0, rows, step):
                f.write(_bf16_bits(np.arange(start, start + step), cols).tobytes())
        assert path.stat().st_size == 8 + len(header) + nbytes

        before = _vm_rss_kb()
        table = MappedEmbedding(path, key)
        assert table.shape == (rows, cols) and table.dtype == mx.bfloat16
        ids = np.random.default_rng(0).integers(0, rows, size=(2, 150))
        ids[0, :5] = ids[1, :5]  # repeated tokens
        out = table(mx.array(ids))
        mx.eval(out)
        after = _vm_rss_kb()

        assert out.shape == (2, 150, cols) and out.dtype == mx.bfloat16
        got = np.array(out.view(mx.uint16))
        assert np.array_equal(got, _bf16_bits(ids.reshape(-1), cols).reshape(2, 150, cols))
        grown = (after - before) * 1024
        print(f"VmRSS {before} kB -> {after} kB: +{grown / 2**20:.1f} MiB for a {nbytes / 2**20:.0f} MiB table")
        assert grown < 0.1 * nbytes
        del table, out
    finally:
        path.unlink(missing_ok=True)


def test_quantized_table_gathers_dequantized_rows(tmp_path):
    table = mx.random.normal((300, 512), key=mx.random.key(0)).astype(mx.bfloat16)
    w, s, b = mx.quantize(table, group_size=64, bits=8)
    base = f"language_model.model.{PLE}"
    path = tmp_path / "q.safetensors"
    mx.save_safetensors(str(path), {f"{base}.weight": w, f"{base}.scales": s, f"{base}.biases": b})
    full = mx.dequantize(w, s, b, group_size=64, bits=8)
    ids = mx.array([[0, 299, 17, 17], [5, 6, 7, 0]])
    for kwargs in [dict(bits=8), dict(group_size=64), dict(dims=512), dict(bits=8, group_size=64)]:
        mapped = MappedEmbedding(path, f"{base}.weight", **kwargs)
        assert mapped.quantized and (mapped.bits, mapped.group_size) == (8, 64)
        out = mapped(ids)
        assert out.dtype == full.dtype and mx.array_equal(out, full[ids]).item()
    # the same as MLX's own QuantizedEmbedding over the full table
    emb = nn.QuantizedEmbedding(300, 512, group_size=64, bits=8)
    emb.update({"weight": w, "scales": s, "biases": b})
    assert mx.array_equal(mapped(ids), emb(ids)).item()
    with pytest.raises(ValueError, match="is quantized: pass bits, group_size or dims"):
        MappedEmbedding(path, f"{base}.weight")
    # Sharding by size can put the scales and biases in other files than the packed weight.
    mx.save_safetensors(str(tmp_path / "a.safetensors"), {f"{base}.scales": s, "x": mx.zeros((2,))})
    mx.save_safetensors(str(tmp_path / "b.safetensors"), {f"{base}.weight": w})
    mx.save_safetensors(str(tmp_path / "c.safetensors"), {f"{base}.biases": b})
    files = [tmp_path / f"{n}.safetensors" for n in "abc"]
    split = map_ple_table(files, [f"{base}.weight"], bits=8)
    assert split.path.name == "b.safetensors" and split.quantized and mx.array_equal(split(ids), full[ids]).item()
    with pytest.raises(ValueError, match="no biases"):
        map_ple_table(files[:2], [f"{base}.weight"], bits=8)


def test_truncated_file_is_a_clear_error(tmp_path):
    path = tmp_path / "t.safetensors"
    key = f"model.{PLE}.weight"
    mx.save_safetensors(str(path), {key: mx.ones((64, 32))})
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    with pytest.raises(gemma4_mlx.CheckpointError, match="truncated"):
        MappedEmbedding(path, key)
    path.write_bytes(data[:5])
    with pytest.raises(gemma4_mlx.CheckpointError, match="truncated"):
        MappedEmbedding(path, key)
    path.write_bytes(struct.pack("<Q", 10**6) + data[8:100])
    with pytest.raises(gemma4_mlx.CheckpointError, match="truncated"):
        MappedEmbedding(path, key)


def test_missing_tensor_and_bad_dtype_are_clear_errors(tmp_path):
    path = tmp_path / "m.safetensors"
    mx.save_safetensors(str(path), {"a": mx.ones((4, 4), dtype=mx.int32), "b": mx.ones((4, 4))})
    with pytest.raises(gemma4_mlx.CheckpointError, match="no tensor"):
        MappedEmbedding(path, f"model.{PLE}.weight")
    with pytest.raises(ValueError, match="dtype I32"):
        MappedEmbedding(path, "a")
    with pytest.raises(ValueError, match="outside the table"):
        MappedEmbedding(path, "b")(mx.array([4]))


def test_truncated_table_in_a_checkpoint(e2b_checkpoint, tmp_path):
    """A checkpoint whose file ends inside the PLE table fails to load with a clear error."""
    import shutil

    folder = tmp_path / "cut"
    shutil.copytree(e2b_checkpoint, folder)
    f = folder / "model.safetensors"
    mapped = map_ple_table([f], [f"model.language_model.{PLE}.weight"])
    cut = mapped.weight.offset + 10
    del mapped
    f.write_bytes(f.read_bytes()[:cut])
    with pytest.raises(gemma4_mlx.CheckpointError, match="truncated"):
        gemma4_mlx.load(folder)


def test_quantized_checkpoint_lazy_ple_identical(e2b_checkpoint, tmp_path):
    """An MLX-format checkpoint with an 8-bit PLE table: mapped rows dequantize like QuantizedEmbedding."""
    import shutil

    # Saved under the checkpoint's names: loaded without merging the projections.
    model = gemma4_mlx.load_model(e2b_checkpoint, lazy_ple=False, merge_projections=False)
    nn.quantize(model, group_size=32, bits=8, class_predicate=lambda path, m: path.endswith(PLE))
    folder = tmp_path / "q8"
    shutil.copytree(e2b_checkpoint, folder)
    (folder / "model.safetensors").unlink()
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config = json.loads((folder / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 8}
    (folder / "config.json").write_text(json.dumps(config))

    # Saved from a merged model, the files name the merged projections: a clear error says so.
    merged_folder = tmp_path / "merged"
    shutil.copytree(folder, merged_folder)
    merged, _ = gemma4_mlx.load(e2b_checkpoint, lazy_ple=False)
    mx.save_safetensors(str(merged_folder / "model.safetensors"), dict(tree_flatten(merged.parameters())))
    (merged_folder / "config.json").write_text((folder / "config.json").read_text().replace('"quantization"', '"_unused"'))
    with pytest.raises(gemma4_mlx.CheckpointError, match="merge_projections=False"):
        gemma4_mlx.load(merged_folder)

    lazy, _ = gemma4_mlx.load(folder)
    full, _ = gemma4_mlx.load(folder, lazy_ple=False)
    assert _ple_params(lazy) == [] and isinstance(full.language_model.embed_tokens_per_layer, nn.QuantizedEmbedding)
    mapped = lazy.language_model.mapped_ple
    assert mapped.quantized and (mapped.bits, mapped.group_size) == (8, 32)
    ids = mx.array(random_ids(30, seed=7))
    assert mx.array_equal(lazy(ids), full(ids)).item()
