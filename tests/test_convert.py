"""`python -m convert`: round trips, what gets quantized, and failures that leave nothing behind."""

import json
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from checkpoints import AUDIO, SMALL_VIT, build_hf_model, dequantized_reference, save_checkpoint
from helpers import rel_err
from safetensors import safe_open

import gemma4_mlx
from convert import ConversionError, OutputFolderError, convert

IDS = mx.array([[2, 5, 6, 7, 300, 400, 500, 9, 10, 11, 12, 40, 41, 42, 43, 44, 45, 46, 47, 48]])


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    # PLE width 10 x 32 = 320, a multiple of the group size, so the PLE table can be quantized.
    hf = build_hf_model("e2b", hidden_size_per_layer_input=32)
    return save_checkpoint(hf, tmp_path_factory.mktemp("e2b_src"))


@pytest.fixture(scope="module")
def reference(src):
    model, _ = gemma4_mlx.load(src)
    return np.array(model(IDS))


def logits(path):
    model, _ = gemma4_mlx.load(path)
    return model, np.array(model(IDS).astype(mx.float32))


def tensors(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "numpy") as s:
            for k in s.keys():
                out[k] = s.get_slice(k).get_dtype()
    return out


def test_float32_round_trip_is_exact(src, reference, tmp_path):
    out = convert(str(src), tmp_path / "f32", dtype="float32", progress=lambda _: None)
    _, got = logits(out)
    assert np.array_equal(got, reference)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in out.glob("*.safetensors")}
    for name in ("tokenizer.json", "chat_template.jinja", "config.json", "README.md"):
        assert (out / name).exists()


def test_bfloat16_matches_loading_as_bfloat16(src, tmp_path):
    out = convert(str(src), tmp_path / "bf16", max_shard_gb=0.0002, progress=lambda _: None)
    assert len(list(out.glob("*.safetensors"))) > 1  # sharded
    model, got = logits(out)
    direct, _ = gemma4_mlx.load(src, dtype="bfloat16")
    assert model.language_model.embed_tokens.weight.dtype == mx.bfloat16
    assert np.array_equal(got, np.array(direct(IDS).astype(mx.float32)))


@pytest.mark.parametrize(
    "opts, bound",
    [
        (dict(q_bits=8), 0.2),
        (dict(q_bits=4), 1.5),
        (dict(q_bits=4, quant_recipe="mixed_4_8"), 1.5),
        (dict(q_bits=4, q_mode="mxfp4", q_group_size=32), 1.5),
    ],
)
def test_quantized_round_trip(src, reference, tmp_path, opts, bound):
    # Small shards split the PLE table's weight from its scales and biases: the mapped table must find them.
    out = convert(str(src), tmp_path / "q", dtype="float32", quantize=True, max_shard_gb=0.0002, progress=lambda _: None, **opts)
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    ple_files = {weight_map[f"language_model.embed_tokens_per_layer.{p}"] for p in ("weight", "scales", "biases")}
    assert len(ple_files) > 1
    cfg = json.loads((out / "config.json").read_text())["quantization"]
    assert cfg["bits"] == opts["q_bits"] and cfg["mode"] == opts.get("q_mode", "affine")
    files = tensors(out)
    assert files["language_model.layers.0.self_attn.q_proj.weight"] == "U32"
    assert "language_model.layers.0.self_attn.q_proj.scales" in files
    assert files["language_model.layers.0.input_layernorm.weight"] == "F32"  # norms stay float
    # The PLE table is never below 8 bits.
    ple = cfg.get("language_model.embed_tokens_per_layer", {"bits": cfg["bits"], "mode": cfg["mode"]})
    assert ple["bits"] >= 8 and ple["mode"] == "affine"
    model, got = logits(out)
    attn = model.language_model.layers[0].self_attn
    # Loading merges q/k/v into one matmul, unless the recipe quantized them differently (v at 8 bits).
    assert ("qkv_proj" in attn) == (opts.get("quant_recipe") != "mixed_4_8")
    assert (attn.qkv_proj if "qkv_proj" in attn else attn.q_proj).bits == opts["q_bits"]
    assert model.language_model.mapped_ple.bits == 8  # mapped (affine 8-bit, also under mxfp4)
    # Against the original: this tiny random model is chaotic (bf16 alone moves its logits by ~6%),
    # so the bound is loose; measured 8-bit 0.09, 4-bit 0.68.
    err = rel_err(got, reference)
    assert 0 < err < bound, err
    # Exactness of the quantized path: the same model with every quantized weight dequantized
    # (PLE table loaded fully, so that it is a module here too).
    model, _ = gemma4_mlx.load(out, lazy_ple=False)
    got = np.array(model(IDS))
    flat = dequantized_reference(out, src)
    # MLX's mxfp4 matmul on this backend is not bit-faithful to the dequantized fp32 product
    # (measured 4e-3 here, amplified by the chaotic model); affine is exact to fp32 rounding.
    assert rel_err(got, np.array(flat(IDS))) < (1e-4 if opts.get("q_mode", "affine") == "affine" else 1e-2)


def test_moe_and_towers(tmp_path):
    hf = build_hf_model("moe26b", vision_config=dict(hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=2, head_dim=32, position_embedding_size=64))  # fmt: skip
    src = save_checkpoint(hf, tmp_path / "src")
    out = convert(str(src), tmp_path / "q", quantize=True, progress=lambda _: None)
    cfg = json.loads((out / "config.json").read_text())["quantization"]
    assert cfg["language_model.layers.0.router.proj"]["bits"] == 8
    files = tensors(out)
    assert files["language_model.layers.0.experts.switch_glu.gate_proj.weight"] == "U32"
    # bf16 on disk, although a CPU runs the experts in float32 (down_proj, 32 wide, stays in float)
    assert files["language_model.layers.0.experts.switch_glu.gate_proj.scales"] == "BF16"
    assert files["language_model.layers.0.experts.switch_glu.down_proj.weight"] == "BF16"
    assert not any(k.startswith("vision_tower.") and k.endswith(".scales") for k in files)  # towers in float
    model, _ = gemma4_mlx.load(out)
    assert model(IDS).shape == (1, IDS.shape[1], 1024)
    towers = convert(str(src), tmp_path / "qt", quantize=True, quantize_towers=True, progress=lambda _: None)
    assert any(k.startswith("vision_tower.") and k.endswith(".scales") for k in tensors(towers))


def test_refuses_existing_output_and_bad_options(src, tmp_path):
    out = tmp_path / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="--force"):
        convert(str(src), out, progress=lambda _: None)
    # --force replaces only an earlier conversion's output: a folder holding anything else is kept.
    with pytest.raises(OutputFolderError, match="keep.txt"):
        convert(str(src), out, force=True, progress=lambda _: None)
    assert (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    convert(str(src), out, progress=lambda _: None)  # an empty folder is fine
    first = (out / "config.json").stat().st_mtime_ns
    convert(str(src), out, force=True, dtype="float32", progress=lambda _: None)  # an earlier output: replaced
    assert json.loads((out / "config.json").read_text())["mlx_dtype"] == "float32"
    assert (out / "config.json").stat().st_mtime_ns != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists"]  # no temporary folder left
    (out / "notes.txt").write_text("added by the user after converting")
    with pytest.raises(OutputFolderError, match="notes.txt"):
        convert(str(src), out, force=True, progress=lambda _: None)
    assert (out / "notes.txt").exists() and (out / "config.json").exists()
    with pytest.raises(ValueError, match="bits"):
        convert(str(src), tmp_path / "x", quantize=True, q_bits=7)
    with pytest.raises(ValueError, match="group-size 32"):
        convert(str(src), tmp_path / "x", quantize=True, q_mode="mxfp4", q_bits=4, q_group_size=64)
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="--max-shard-gb must be a positive number of GB"):
            convert(str(src), tmp_path / "x", max_shard_gb=bad)


def test_force_never_replaces_the_input_or_a_folder_holding_it(src, tmp_path):
    import shutil

    parent = tmp_path / "models"
    ckpt = parent / "ckpt"
    shutil.copytree(src, ckpt)
    (parent / "unrelated.txt").write_text("keep me")
    before = sorted(p.name for p in ckpt.iterdir())
    for target in (ckpt, parent, tmp_path, ckpt / ".." / "ckpt"):
        with pytest.raises(OutputFolderError, match="input checkpoint"):
            convert(str(ckpt), target, force=True, progress=lambda _: None)
    # A converted folder used as input cannot be its own output either (it would pass the content check).
    converted = convert(str(ckpt), tmp_path / "bf16", progress=lambda _: None)
    with pytest.raises(OutputFolderError, match="input checkpoint itself"):
        convert(str(converted), converted, force=True, quantize=True, progress=lambda _: None)
    assert sorted(p.name for p in ckpt.iterdir()) == before and (parent / "unrelated.txt").exists()
    assert (converted / "config.json").exists()
    # A file, or a link to a folder, is never replaced.
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(OutputFolderError, match="not a folder"):
        convert(str(ckpt), tmp_path / "a_file", force=True, progress=lambda _: None)
    (tmp_path / "link").symlink_to(converted)
    with pytest.raises(OutputFolderError, match="not a folder"):
        convert(str(ckpt), tmp_path / "link", force=True, progress=lambda _: None)


def test_leftovers_of_a_killed_conversion_are_cleaned_up(src, tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)  # a process that has exited
    stale = tmp_path / f".out.partial-{dead_pid}-abc123"
    stale.mkdir()
    (stale / "model-00001-of-00002.safetensors").write_bytes(b"half written")
    running = tmp_path / f".out.partial-{os.getppid()}-def456"  # a conversion still running elsewhere
    running.mkdir()
    messages = []
    convert(str(src), tmp_path / "out", progress=messages.append)
    assert not stale.exists() and running.exists()
    assert any(stale.name in m for m in messages)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", running.name])


def test_failures_leave_nothing_behind(src, tmp_path, monkeypatch):
    leftovers = lambda: sorted(p.name for p in tmp_path.iterdir())  # noqa: E731
    with pytest.raises(FileNotFoundError):
        convert(str(tmp_path / "missing"), tmp_path / "o1")
    bad = tmp_path / "llama"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(gemma4_mlx.UnsupportedModelError):
        convert(str(bad), tmp_path / "o2")
    assert leftovers() == ["llama"]

    calls = []

    def disk_full(path, arrays, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real_save(path, arrays, metadata=metadata)

    real_save = mx.save_safetensors
    monkeypatch.setattr(mx, "save_safetensors", disk_full)
    with pytest.raises(ConversionError, match="No space left"):
        convert(str(src), tmp_path / "o3", max_shard_gb=0.0002, progress=lambda _: None)
    assert len(calls) == 2 and leftovers() == ["llama"]  # no output, no partial folder


def test_corrupt_source_writes_nothing(src, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    f = next(broken.glob("*.safetensors"))
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(gemma4_mlx.CheckpointError, match="truncated"):
        convert(str(broken), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_command_line(src, tmp_path):
    out = tmp_path / "cli"
    run = subprocess.run([sys.executable, "-m", "convert", "--hf-path", str(src), "--mlx-path", str(out), "-q"],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "[1/1]" in run.stdout and (out / "config.json").exists()
    again = subprocess.run([sys.executable, "-m", "convert", "--hf-path", str(src), "--mlx-path", str(out)],
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert again.returncode == 1 and again.stderr.startswith("error:") and "--force" in again.stderr


@pytest.fixture(scope="module")
def mm_src(tmp_path_factory):
    hf = build_hf_model("e2b", vision_config=SMALL_VIT, audio_config=AUDIO, hidden_size_per_layer_input=32)
    return save_checkpoint(hf, tmp_path_factory.mktemp("e2b_mm_src"))


@pytest.mark.parametrize(
    "opts",
    [
        dict(),
        dict(dtype="float32"),
        dict(quantize=True, q_bits=8),
        dict(quantize=True, q_bits=4),
        dict(quantize=True, q_bits=3, quant_recipe="mixed_3_6"),
        dict(quantize=True, q_bits=4, q_mode="mxfp4", q_group_size=32),
        dict(quantize=True, q_bits=4, quantize_towers=True),
    ],
)
def test_computed_sizes_equal_the_written_folder(mm_src, tmp_path, opts):
    """convert.sizes (the README's size table) computes exactly the tensor bytes convert writes."""
    from convert.sizes import converted_bytes

    from gemma4_mlx.loading.ple import read_safetensors_header

    out = convert(str(mm_src), tmp_path / "o", max_shard_gb=0.0005, progress=lambda _: None, **opts)
    computed = converted_bytes(json.loads((mm_src / "config.json").read_text()), **opts)
    assert computed["ple"] > 0 and computed["vision"] > 0 and computed["audio"] > 0
    files = sorted(out.glob("*.safetensors"))
    headers = [read_safetensors_header(f) for f in files]  # (JSON header, 8 + its length)
    data = sum(f.stat().st_size for f in files) - sum(start for _, start in headers)
    assert computed["total"] == data == json.loads((out / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    assert len(files) > 1 and max(start for _, start in headers) < 64_000
    ple = sum(e - b for h, _ in headers for k, v in h.items() if "embed_tokens_per_layer" in k for b, e in [v["data_offsets"]])
    assert computed["ple"] == ple


def test_size_table_of_the_real_variants(capsys):
    from convert.sizes import converted_bytes, main

    from gemma4_mlx.variants import published_config

    e2b = published_config("e2b")
    ple_rows, ple_cols = 262_144, 35 * 256
    assert converted_bytes(e2b)["ple"] == ple_rows * ple_cols * 2  # bf16, 4.70 GB
    q4 = converted_bytes(e2b, quantize=True)
    assert q4["ple"] == ple_rows * ple_cols * (1 + 2 * 2 / 64)  # 8-bit codes + bf16 scale and bias per 64
    assert q4["vision"] == converted_bytes(e2b)["vision"]  # towers stay float
    table = main(["--variants", "e2b", "31b"])
    assert table.count("\n") == 3 and "| e2b | 5.10B |" in table and capsys.readouterr().out.strip() == table
