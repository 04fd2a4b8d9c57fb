"""Config parsing, checkpoint loading (HF layouts, shards, dtypes) and clear errors on bad input.

Real-variant configs are checked without weights; weights come from tiny random checkpoints written
by transformers 5.23 (see ``checkpoints.py``), whose logits are the reference.
"""

import copy
import hashlib
import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
import torch
from mlx.utils import tree_flatten

import gemma4_mlx
from checkpoints import FAMILIES, build_hf_model, save_checkpoint, text_config, to_published_form
from helpers import hf_logits, random_ids, rel_err
from gemma4_mlx.errors import ConfigError
from gemma4_mlx.testing import media_token_ids

S, F = "sliding_attention", "full_attention"


# --------------------------------------------------------------------------- helpers
def snapshot(folder: Path) -> dict[str, str]:
    """Every entry under ``folder`` with the hash of its bytes (directories marked as such)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        out[rel] = "<dir>" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def edit_config(folder: Path, **changes) -> None:
    """Change text-decoder fields of config.json (inside ``text_config`` when there is one)."""
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    target = raw.get("text_config", raw)
    target.update(changes)
    path.write_text(json.dumps(raw, indent=2))


# --------------------------------------------------------------------------- published configs
ROPE = {
    S: {"rope_type": "default", "rope_theta": 10_000.0},
    F: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
_COMMON = dict(
    model_type="gemma4_text",
    vocab_size=262_144,
    vocab_size_per_layer_input=262_144,
    head_dim=256,
    global_head_dim=512,
    hidden_activation="gelu_pytorch_tanh",
    final_logit_softcapping=30.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    rope_parameters=ROPE,
    attention_bias=False,
    attention_dropout=0.0,
    initializer_range=0.02,
    use_cache=True,
    dtype="bfloat16",
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)
E2B = dict(
    _COMMON,
    hidden_size=1536,
    intermediate_size=6144,
    num_hidden_layers=35,
    layer_types=[S, S, S, S, F] * 7,
    num_attention_heads=8,
    num_key_value_heads=1,
    num_global_key_value_heads=None,
    attention_k_eq_v=False,
    num_kv_shared_layers=20,
    hidden_size_per_layer_input=256,
    use_double_wide_mlp=True,
    sliding_window=512,
    max_position_embeddings=131_072,
    enable_moe_block=False,
    num_experts=None,
    top_k_experts=None,
    moe_intermediate_size=None,
    use_bidirectional_attention=None,
)
E4B = dict(
    E2B,
    hidden_size=2560,
    intermediate_size=10240,
    num_hidden_layers=42,
    layer_types=([S] * 5 + [F]) * 7,
    num_key_value_heads=2,
    num_kv_shared_layers=18,
)
A4B = dict(
    _COMMON,
    hidden_size=2816,
    intermediate_size=2112,
    num_hidden_layers=30,
    layer_types=([S] * 5 + [F]) * 5,
    num_attention_heads=16,
    num_key_value_heads=8,
    num_global_key_value_heads=2,
    attention_k_eq_v=True,
    num_kv_shared_layers=0,
    hidden_size_per_layer_input=0,
    use_double_wide_mlp=False,
    sliding_window=1024,
    max_position_embeddings=262_144,
    enable_moe_block=True,
    num_experts=128,
    top_k_experts=8,
    moe_intermediate_size=704,
    use_bidirectional_attention="vision",
)
D31B = dict(
    A4B,
    hidden_size=5376,
    intermediate_size=21504,
    num_hidden_layers=60,
    layer_types=([S] * 5 + [F]) * 10,
    num_attention_heads=32,
    num_key_value_heads=16,
    num_global_key_value_heads=4,
    enable_moe_block=False,
    num_experts=None,
    top_k_experts=None,
    moe_intermediate_size=None,
)
PUBLISHED = {"e2b": E2B, "e4b": E4B, "26b-a4b": A4B, "31b": D31B}

# What each variant must resolve to (from GEMMA4.md), written out independently of the parser.
EXPECTED = {
    # first KV-shared layer, K/V source of shared sliding / full layers, sliding & full (head_dim, kv heads),
    # K=V on full layers, MLP width of non-shared / shared layers
    "e2b": dict(layers=35, first_shared=15, src={S: 13, F: 14}, sliding=(256, 1), full=(512, 1), k_eq_v=False, mlp=(6144, 12288)),
    "e4b": dict(layers=42, first_shared=24, src={S: 22, F: 23}, sliding=(256, 2), full=(512, 2), k_eq_v=False, mlp=(10240, 20480)),
    "26b-a4b": dict(layers=30, first_shared=30, src={}, sliding=(256, 8), full=(512, 2), k_eq_v=True, mlp=(2112, None)),
    "31b": dict(layers=60, first_shared=60, src={}, sliding=(256, 16), full=(512, 4), k_eq_v=True, mlp=(21504, None)),
}


def published_config(variant: str, **top) -> dict:
    return {"model_type": "gemma4", "text_config": copy.deepcopy(PUBLISHED[variant]), **top}


@pytest.mark.parametrize("variant", sorted(PUBLISHED))
def test_published_variant_configs_resolve_per_layer(variant):
    cfg = gemma4_mlx.ModelConfig.from_dict(published_config(variant))
    text, exp = cfg.text_config, EXPECTED[variant]
    layers = text.layers
    assert len(layers) == exp["layers"] == text.num_hidden_layers
    assert [s.index for s in layers] == list(range(exp["layers"]))
    assert [s.layer_type for s in layers] == PUBLISHED[variant]["layer_types"]
    for s in layers:
        shared = s.index >= exp["first_shared"]
        assert s.is_kv_shared == shared, s
        assert s.kv_source == (exp["src"][s.layer_type] if shared else s.index), s
        assert (s.head_dim, s.num_kv_heads) == (exp["sliding"] if s.is_sliding else exp["full"]), s
        assert s.k_eq_v == (exp["k_eq_v"] and not s.is_sliding), s
        assert s.mlp_size == (exp["mlp"][1] if shared else exp["mlp"][0]), s
    # Source layers own their K/V and are of the type they serve.
    for layer_type, src in exp["src"].items():
        assert layers[src].layer_type == layer_type and not layers[src].is_kv_shared
    assert text.vocab_size == 262_144
    assert text.final_logit_softcapping == 30.0
    # Published leftovers that we do not use are kept, not rejected.
    assert text.extra["initializer_range"] == 0.02 and text.extra["use_cache"] is True


def test_e2b_and_e4b_specifics():
    e2b = gemma4_mlx.ModelConfig.from_dict(published_config("e2b")).text_config
    assert e2b.has_per_layer_inputs and e2b.hidden_size_per_layer_input == 256
    assert [s.index for s in e2b.layers if s.is_kv_shared] == list(range(15, 35))
    assert {s.kv_source for s in e2b.layers if s.is_kv_shared and s.is_sliding} == {13}
    assert {s.kv_source for s in e2b.layers if s.is_kv_shared and not s.is_sliding} == {14}
    assert {s.mlp_size for s in e2b.layers[15:]} == {12288}
    assert {s.mlp_size for s in e2b.layers[:15]} == {6144}
    # Global kv heads apply only with attention_k_eq_v: E2B ignores them.
    raw = published_config("e2b")
    raw["text_config"]["num_global_key_value_heads"] = 4
    assert {s.num_kv_heads for s in gemma4_mlx.ModelConfig.from_dict(raw).text_config.layers} == {1}


def test_moe_variant_specifics():
    text = gemma4_mlx.ModelConfig.from_dict(published_config("26b-a4b")).text_config
    assert text.enable_moe_block and (text.num_experts, text.top_k_experts, text.moe_intermediate_size) == (128, 8, 704)
    assert text.hidden_size == 2816 and text.intermediate_size == 2112
    assert not text.has_per_layer_inputs
    full = [s for s in text.layers if not s.is_sliding]
    assert [s.index for s in full] == [5, 11, 17, 23, 29]
    assert all(s.head_dim == 512 and s.num_kv_heads == 2 and s.k_eq_v for s in full)
    assert all(s.head_dim == 256 and s.num_kv_heads == 8 and not s.k_eq_v for s in text.layers if s.is_sliding)
    # MoE without its sizes is rejected with a message naming the missing fields.
    raw = published_config("26b-a4b")
    raw["text_config"]["num_experts"] = None
    with pytest.raises(gemma4_mlx.UnsupportedModelError, match="num_experts"):
        gemma4_mlx.ModelConfig.from_dict(raw)


@pytest.mark.parametrize("variant", sorted(PUBLISHED))
def test_published_configs_agree_with_transformers(variant):
    """transformers 5.23 reads the same published dict into the same per-layer shapes and KV sharing."""
    from transformers import Gemma4TextConfig

    raw = {k: v for k, v in PUBLISHED[variant].items() if k not in ("model_type", "dtype")}
    hf = Gemma4TextConfig(**copy.deepcopy(raw))
    ours = gemma4_mlx.ModelConfig.from_dict(published_config(variant)).text_config
    modes = hf.kv_sharing_modes
    stores = {hf.layer_types[i]: i for i, m in enumerate(modes) if m == "store"}
    for s in ours.layers:
        lc = hf.per_layer_config[s.index]
        assert (s.head_dim, s.num_kv_heads) == (lc.head_dim, lc.num_key_value_heads), s
        assert s.kv_source == (stores[s.layer_type] if modes[s.index] == "reuse" else s.index), s
        assert s.mlp_size == hf.intermediate_size * (2 if hf.use_double_wide_mlp and modes[s.index] == "reuse" else 1)


def _transformers_form(text: dict, **top) -> dict:
    """config.json as transformers 5.23's save_pretrained writes it (``per_layer_config``)."""
    from transformers import Gemma4Config

    text = {k: v for k, v in text.items() if k not in ("model_type", "dtype")}
    return Gemma4Config(text_config=copy.deepcopy(text), vision_config=None, audio_config=None, **top).to_dict()


@pytest.mark.parametrize("variant", sorted(PUBLISHED))
def test_transformers_form_of_published_configs_resolves_identically(variant):
    saved = _transformers_form(PUBLISHED[variant])
    assert "per_layer_config" in saved["text_config"] and "global_head_dim" not in saved["text_config"]
    a = gemma4_mlx.ModelConfig.from_dict(saved).text_config.layers
    b = gemma4_mlx.ModelConfig.from_dict(published_config(variant)).text_config.layers
    assert a == b


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tiny_transformers_form_and_published_form_resolve_identically(family, tmp_path):
    saved = _transformers_form(text_config(family), **media_token_ids())
    path = tmp_path / "config.json"
    path.write_text(json.dumps(saved))
    transformers_form = gemma4_mlx.ModelConfig.from_file(path)
    to_published_form(path)
    published = json.loads(path.read_text())
    assert "per_layer_config" not in published["text_config"] and "vocab_size" not in published
    published_form = gemma4_mlx.ModelConfig.from_file(path)
    assert transformers_form.text_config.layers == published_form.text_config.layers
    # The tiny families really differ between layer types (else the comparison would be vacuous).
    assert {s.head_dim for s in published_form.text_config.layers} == {32, 64}


def test_vocab_size_comes_from_text_config_when_top_level_lacks_it():
    raw = published_config("e2b")
    raw["text_config"]["vocab_size"] = 1234
    assert "vocab_size" not in raw
    assert gemma4_mlx.ModelConfig.from_dict(raw).text_config.vocab_size == 1234
    # ... and from the top level when only that has it.
    raw = published_config("e2b", vocab_size=4321)
    del raw["text_config"]["vocab_size"]
    assert gemma4_mlx.ModelConfig.from_dict(raw).text_config.vocab_size == 4321


def test_unknown_keys_are_kept_in_extra():
    raw = published_config("31b", some_future_field={"a": 1}, vision_soft_tokens_per_image=280)
    raw["text_config"]["another_new_field"] = [1, 2, 3]
    cfg = gemma4_mlx.ModelConfig.from_dict(raw)
    assert cfg.extra["some_future_field"] == {"a": 1}
    assert cfg.extra["vision_soft_tokens_per_image"] == 280
    assert cfg.text_config.extra["another_new_field"] == [1, 2, 3]
    assert "another_new_field" not in cfg.extra and "some_future_field" not in cfg.text_config.extra


@pytest.mark.parametrize("eoa_name", ["eoa_token_index", "eoa_token_id"])
def test_special_token_ids_come_from_the_config(eoa_name):
    ids = {
        "image_token_id": 1001,
        "audio_token_id": 1002,
        "video_token_id": 1003,
        "boi_token_id": 1004,
        "eoi_token_id": 1005,
        "boa_token_id": 1006,
        eoa_name: 1007,
    }
    cfg = gemma4_mlx.ModelConfig.from_dict(published_config("e2b", **ids))
    got = {name: getattr(cfg, name) for name in ids if name != eoa_name}
    assert got == {k: v for k, v in ids.items() if k != eoa_name}
    assert cfg.eoa_token_id == 1007
    assert not set(ids) & set(cfg.extra)
    # The tiny checkpoints' ids (transformers' eoa_token_index spelling) are far from the published ones.
    tiny = gemma4_mlx.ModelConfig.from_dict(published_config("e2b", **media_token_ids()))
    assert tiny.eoa_token_id == media_token_ids()["eoa_token_index"]
    assert tiny.image_token_id == media_token_ids()["image_token_id"] != 258_880


def test_non_gemma4_config_is_rejected_by_name():
    with pytest.raises(gemma4_mlx.UnsupportedModelError, match="llama"):
        gemma4_mlx.ModelConfig.from_dict({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})


# --------------------------------------------------------------------------- tiny checkpoints
@pytest.fixture(scope="module")
def text_hf():
    return build_hf_model("e2b", text_only=True)


@pytest.fixture(scope="module")
def text_path(text_hf, tmp_path_factory):
    return save_checkpoint(text_hf, tmp_path_factory.mktemp("text_only"))


@pytest.fixture(scope="module")
def sharded_path(text_hf, tmp_path_factory):
    return save_checkpoint(text_hf, tmp_path_factory.mktemp("sharded"), max_shard_size="50KB")


@pytest.fixture(scope="module")
def bf16(text_hf, tmp_path_factory):
    """A bf16 checkpoint of the same weights, and the fp32 model holding exactly the rounded weights."""
    path = save_checkpoint(copy.deepcopy(text_hf), tmp_path_factory.mktemp("bf16"), dtype=torch.bfloat16)
    # Round only what the checkpoint holds (transformers' .to() would also round its RoPE tables).
    rounded = copy.deepcopy(text_hf)
    rounded.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in text_hf.state_dict().items()})
    return path, rounded


@pytest.fixture(scope="module")
def text_loaded(text_path):
    return gemma4_mlx.load(text_path)


@pytest.fixture(scope="module")
def ids():
    return random_ids(24, seed=7)


def test_text_only_checkpoint_matches_hf(text_hf, text_path, text_loaded, ids):
    assert json.loads((text_path / "config.json").read_text())["model_type"] == "gemma4_text"
    model, processor = text_loaded
    assert model.config.model_type == "gemma4_text"
    assert model.language_model.embed_tokens.weight.dtype == mx.float32
    ours = model(mx.array(ids.numpy()))
    ref = hf_logits(text_hf, ids)
    assert ours.shape == ref.shape
    assert rel_err(ours, ref) < 1e-4
    assert {1, 106} <= processor.eos_token_ids


def test_sharded_checkpoint_matches_hf(text_hf, sharded_path, ids):
    index = json.loads((sharded_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    assert not (sharded_path / "model.safetensors").exists()
    assert sorted(p.name for p in sharded_path.glob("*.safetensors")) == shards
    model, _ = gemma4_mlx.load(sharded_path)
    assert rel_err(model(mx.array(ids.numpy())), hf_logits(text_hf, ids)) < 1e-4


def test_bf16_checkpoint_keeps_bf16_and_stays_close(text_hf, bf16, ids):
    path, _ = bf16
    model, _ = gemma4_mlx.load(path)
    assert model.language_model.embed_tokens.weight.dtype == mx.bfloat16
    floats = [v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)]
    assert floats and set(floats) == {mx.bfloat16}
    logits = model(mx.array(ids.numpy()))
    assert logits.dtype == mx.bfloat16
    ref = hf_logits(text_hf, ids)
    err = rel_err(logits, ref)
    # bf16 rounding alone moves this random 10-layer model's logits by several percent: transformers'
    # own bf16 run of the same checkpoint is the yardstick (about 9% here), ours must stay near it.
    hf_bf16 = copy.deepcopy(text_hf).to(torch.bfloat16)
    hf_err = rel_err(mx.array(hf_logits(hf_bf16, ids)), ref)
    assert err < 1.5 * hf_err and err < 0.15, f"bf16 logits are {err:.3g} from fp32 (transformers bf16: {hf_err:.3g})"


def test_dtype_override_upcasts_a_bf16_checkpoint(bf16, ids):
    path, hf_rounded = bf16
    model, _ = gemma4_mlx.load(path, dtype="float32")
    floats = {v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)}
    assert floats == {mx.float32}
    # fp32 compute on bf16-rounded weights: the same as transformers on the same rounded weights.
    assert rel_err(model(mx.array(ids.numpy())), hf_logits(hf_rounded, ids)) < 1e-4


def test_dtype_must_be_known(text_path):
    with pytest.raises(ValueError, match="dtype must be one of"):
        gemma4_mlx.load(text_path, dtype="int3")


def test_lazy_load_matches_hf(text_hf, text_path, ids):
    model, _ = gemma4_mlx.load(text_path, lazy=True)
    assert rel_err(model(mx.array(ids.numpy())), hf_logits(text_hf, ids)) < 1e-4


def test_successful_load_leaves_the_folder_alone(text_path):
    before = snapshot(text_path)
    gemma4_mlx.load(text_path)
    assert snapshot(text_path) == before


# --------------------------------------------------------------------------- bad input
def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        gemma4_mlx.load(tmp_path / "no-such-model")


@pytest.mark.parametrize("name", ["not a model!", "a/b/c", "./relative/missing"])
def test_path_that_is_neither_folder_nor_repo_id(name):
    with pytest.raises(FileNotFoundError, match="model folder not found"):
        gemma4_mlx.load(name)


def test_a_file_instead_of_a_folder(text_path):
    with pytest.raises(FileNotFoundError, match="is a file"):
        gemma4_mlx.load(text_path / "config.json")


def _to_llama(folder: Path):
    raw = json.loads((folder / "config.json").read_text())
    raw.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (folder / "config.json").write_text(json.dumps(raw))


def _drop_weights(folder: Path):
    (folder / "model.safetensors").unlink()


def _truncate(folder: Path):
    f = folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _drop_a_shard(folder: Path):
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    (folder / sorted(set(index["weight_map"].values()))[-1]).unlink()


def _truncate_a_shard(folder: Path):
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    f = folder / max(set(index["weight_map"].values()), key=lambda n: (folder / n).stat().st_size)
    f.write_bytes(f.read_bytes()[:-100])


def _bad_index(folder: Path):
    (folder / "model.safetensors.index.json").write_text('{"metadata": {}}')


def _wider_hidden(folder: Path):
    edit_config(folder, hidden_size=96)


def _drop_a_tensor(folder: Path):
    from safetensors.numpy import load_file, save_file

    f = folder / "model.safetensors"
    tensors = load_file(str(f))
    del tensors["model.layers.0.self_attn.q_proj.weight"]
    save_file(tensors, str(f), metadata={"format": "pt"})


def _drop_config(folder: Path):
    (folder / "config.json").unlink()


def _garble_config(folder: Path):
    (folder / "config.json").write_text('{"model_type": "gemma4_text", ')


def _config_is_a_list(folder: Path):
    (folder / "config.json").write_text(json.dumps([json.loads((folder / "config.json").read_text())]))


def _config_not_utf8(folder: Path):
    (folder / "config.json").write_bytes(b'{"model_type": "gemma4_text", "name": "\xff\xfe"}')


def _string_hidden_size(folder: Path):
    edit_config(folder, hidden_size="64")


def _zero_layers(folder: Path):
    edit_config(folder, num_hidden_layers=0, layer_types=[])


def _weight_map_is_a_list(folder: Path):
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"] = list(index["weight_map"].values())
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _index_not_utf8(folder: Path):
    (folder / "model.safetensors.index.json").write_bytes(b'{"weight_map": {"a": "\xff.safetensors"}}')


def _shard_outside_the_folder(folder: Path):
    """An index entry pointing at a real safetensors file beside the folder."""
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    name = sorted(set(index["weight_map"].values()))[0]
    shutil.copy(folder / name, folder.parent / "outside.safetensors")
    index["weight_map"] = {k: ("../outside.safetensors" if v == name else v) for k, v in index["weight_map"].items()}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _shard_absolute_path(folder: Path):
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    name = sorted(set(index["weight_map"].values()))[0]
    index["weight_map"] = {k: (str(folder / v) if v == name else v) for k, v in index["weight_map"].items()}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


BAD = {
    # name: (source, how to break it, exception, message fragment)
    "not_gemma4": ("single", _to_llama, gemma4_mlx.UnsupportedModelError, "'llama'"),
    "no_weights": ("single", _drop_weights, gemma4_mlx.CheckpointError, r"no \*\.safetensors weights in"),
    "truncated": ("single", _truncate, gemma4_mlx.CheckpointError, "truncated safetensors file .*model.safetensors"),
    "missing_shard": ("sharded", _drop_a_shard, gemma4_mlx.CheckpointError, "missing weight shards listed in its index: model-"),
    "truncated_shard": ("sharded", _truncate_a_shard, gemma4_mlx.CheckpointError, r"truncated safetensors file .*model-\d+-of-\d+\.safetensors"),
    "bad_index": ("sharded", _bad_index, gemma4_mlx.CheckpointError, "not a valid safetensors index"),
    "shape_mismatch": ("single", _wider_hidden, gemma4_mlx.CheckpointError, r"do not match its config.json: .* has shape"),
    "missing_tensor": ("single", _drop_a_tensor, gemma4_mlx.CheckpointError, r"missing 1 tensors .*layers\.0\.self_attn\.q_proj\.weight"),
    "no_config": ("single", _drop_config, FileNotFoundError, "no config.json"),
    "garbled_config": ("single", _garble_config, gemma4_mlx.UnsupportedModelError, "config.json is not valid JSON"),
    "config_list": ("single", _config_is_a_list, ConfigError, "config.json: a config must be a JSON object, not list"),
    "config_not_utf8": ("single", _config_not_utf8, ConfigError, r"config.json is not UTF-8 text \(byte \d+\)"),
    "string_hidden_size": ("single", _string_hidden_size, ConfigError, r"config.json: config.hidden_size must be int, not '64' \(str\)"),
    "zero_layers": ("single", _zero_layers, ConfigError, "config.json: config.num_hidden_layers must be positive, not 0"),
    "weight_map_list": ("sharded", _weight_map_is_a_list, gemma4_mlx.CheckpointError, "index.json is not a valid safetensors index: its weight_map is list"),
    "index_not_utf8": ("sharded", _index_not_utf8, gemma4_mlx.CheckpointError, "index.json is not UTF-8 text"),
    "shard_outside": ("sharded", _shard_outside_the_folder, gemma4_mlx.CheckpointError, r"names the shard '\.\./outside\.safetensors', which is outside the model folder"),
    "shard_absolute": ("sharded", _shard_absolute_path, gemma4_mlx.CheckpointError, "which is outside the model folder"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_checkpoint_fails_clearly_and_leaves_the_folder_alone(case, text_path, sharded_path, tmp_path):
    source, breaker, exc, fragment = BAD[case]
    folder = tmp_path / case
    shutil.copytree(text_path if source == "single" else sharded_path, folder)
    breaker(folder)
    before = snapshot(folder)
    with pytest.raises(exc, match=fragment):
        gemma4_mlx.load(folder)
    assert snapshot(folder) == before


def test_token_id_outside_the_vocabulary(text_loaded):
    model, processor = text_loaded
    with pytest.raises(gemma4_mlx.TokenIdError, match="99999 is outside the vocabulary"):
        model(mx.array([[1, 5, 99999]]))
    with pytest.raises(gemma4_mlx.TokenIdError, match="-3 is outside the vocabulary"):
        model(mx.array([[1, -3, 5]]))
    with pytest.raises(gemma4_mlx.TokenIdError, match="99999 is outside the vocabulary"):
        list(gemma4_mlx.stream_generate(model, processor, [2, 5, 99999], max_tokens=3))
    # Ids no integer type holds, and ids that are not ints, are named too (not a failure inside MLX).
    with pytest.raises(gemma4_mlx.TokenIdError, match=f"{2**63} is outside the vocabulary"):
        list(gemma4_mlx.stream_generate(model, processor, [2, 5, 2**63], max_tokens=2))
    with pytest.raises(TypeError, match="got 5.5 in a list"):
        list(gemma4_mlx.stream_generate(model, processor, [2, 5.5], max_tokens=2))
    # The same ids inside the vocabulary are fine.
    assert len(list(gemma4_mlx.stream_generate(model, processor, [2, 5, 999], max_tokens=2))) >= 1


@pytest.fixture(scope="module")
def short_context(e2b, tmp_path_factory):
    """A copy of the multimodal e2b checkpoint whose context is 32 tokens."""
    folder = tmp_path_factory.mktemp("short_context") / "ckpt"
    shutil.copytree(e2b.path, folder)
    raw = json.loads((folder / "config.json").read_text())
    raw["text_config"]["max_position_embeddings"] = 32
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    return gemma4_mlx.load(folder)


def _no_stop(tokens, logits):
    return logits.at[:, mx.array([1, 106])].add(-1e9)


def test_prompt_longer_than_the_context(short_context):
    model, processor = short_context
    assert model.text_config.max_position_embeddings == 32
    prompt = list(range(200, 240))
    with pytest.raises(gemma4_mlx.ContextLengthError, match="prompt of 40 tokens .* context of 32 tokens"):
        list(gemma4_mlx.stream_generate(model, processor, prompt, max_tokens=4))
    with pytest.raises(gemma4_mlx.ContextLengthError, match="context of 32"):
        gemma4_mlx.generate(model, processor, "hello " * 40)
    # A prompt that fits generates only up to the end of the context.
    chunks = list(gemma4_mlx.stream_generate(model, processor, prompt[:20], max_tokens=100, logits_processors=[_no_stop]))
    assert len(chunks) == 32 - 20
    assert chunks[-1].finish_reason == "length"
