"""A checkpoint's weight files and names: the safetensors index, reading, and mapping the names of
every layout we load (HF multimodal and text-only, mlx-vlm, mlx-lm, ours) onto our module tree."""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..config import ModelConfig, read_json_object
from ..errors import CheckpointError, ConfigError

# Tower weights belong to the multimodal encoders; the text model ignores them.
TOWER_PREFIXES = ("vision_tower.", "audio_tower.", "embed_vision.", "embed_audio.", "multi_modal_projector.", "vision_embedder.")


def _shard_name(index: Path, name: Any) -> str:
    """A shard file name from an index, refused unless it names a file inside the model folder."""
    if not isinstance(name, str) or not name.endswith(".safetensors"):
        raise CheckpointError(f"{index} is not a valid safetensors index: {name!r} is not a .safetensors file name")
    parts = PurePosixPath(name.replace("\\", "/")).parts
    if not parts or PurePosixPath(name).is_absolute() or Path(name).is_absolute() or ".." in parts:
        raise CheckpointError(f"{index} names the shard {name!r}, which is outside the model folder; refusing to load it")
    return name


def weight_files(model_path: Path, keep=None) -> list[Path]:
    """The safetensors files of a checkpoint, from its index if it has one (names that would leave
    the folder, such as ``../x.safetensors`` or absolute paths, are refused). ``keep`` (a test on
    our module tree's names): only the indexed files holding a weight it keeps (a pipeline process's
    part; the others need not be there)."""
    index = model_path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = read_json_object(index, "a safetensors index")["weight_map"]
        except (ConfigError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index ({e})") from None
        if not isinstance(weight_map, dict) or not weight_map:
            kind = type(weight_map).__name__ if not isinstance(weight_map, dict) else "an empty object"
            raise CheckpointError(f"{index} is not a valid safetensors index: its weight_map is {kind}, not a tensor -> file map")
        names = {str(f) for k, f in weight_map.items() if keep is None or keep(rename(str(k)))}
        files = [model_path / _shard_name(index, name) for name in sorted(names)]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{model_path} is missing weight shards listed in its index: {', '.join(missing)}")
        return files
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors weights in {model_path}")
    return files


def read_weights(files: list[Path]) -> dict[str, mx.array]:
    """Read safetensors lazily (MLX maps the data in when it is first used)."""
    weights: dict[str, mx.array] = {}
    for f in files:
        try:
            weights.update(mx.load(str(f)))
        except (RuntimeError, ValueError) as e:
            raise CheckpointError(f"corrupt or truncated safetensors file {f}: {e}") from None
    return weights


def _layer_index(key: str) -> int | None:
    m = re.search(r"layers\.(\d+)\.", key)
    return int(m.group(1)) if m else None


def rename(key: str) -> str:
    """A weight (or module) name in any layout we load -> our module tree's name.

    HF multimodal ``model.language_model.*``, HF text-only ``model.*``, mlx-vlm / mlx-lm ``gemma4``
    ``language_model.model.*``; tower names (``model.vision_tower.*`` or bare ``vision_tower.*``) keep
    their own prefix. Our names pass through unchanged.
    """
    if key.startswith("model.language_model."):
        return "language_model." + key[len("model.language_model.") :]
    if key.startswith("language_model.model."):
        return "language_model." + key[len("language_model.model.") :]
    if key.startswith("language_model.lm_head."):
        return key[len("language_model.") :]
    if key.startswith("model."):
        rest = key[len("model.") :]
        return rest if rest.startswith(TOWER_PREFIXES) else "language_model." + rest
    return key


def sanitize(weights: dict[str, mx.array], config: ModelConfig) -> dict[str, mx.array]:
    """Map checkpoint names onto our module tree and drop what the model does not use.

    Handles HF ``model.language_model.*`` (multimodal), HF ``model.*`` (text-only) and the
    mlx-vlm/mlx-community ``language_model.model.*`` layouts.
    """
    text = config.text_config
    shared = {s.index for s in text.layers if s.is_kv_shared}
    out: dict[str, mx.array] = {}
    for key, value in weights.items():
        k = rename(key)
        if k.startswith(TOWER_PREFIXES):
            tower = k.split(".", 1)[0]
            if (tower in ("vision_tower", "embed_vision", "vision_embedder") and config.vision_config) or (
                tower in ("audio_tower", "embed_audio") and config.audio_config
            ):
                out[k] = value
            continue
        if "rotary_emb" in k or k.endswith("inv_freq"):
            continue  # RoPE tables are recomputed, never loaded
        if k.startswith("lm_head.") and text.tie_word_embeddings:
            continue
        layer = _layer_index(k)
        if layer in shared and re.search(r"self_attn\.(k_proj|v_proj|k_norm|v_norm)\.", k):
            continue  # KV-shared layers never compute K/V; released E2B files still carry them
        if k.endswith(".experts.gate_up_proj"):
            # [E, 2*I, H], gate rows first -> SwitchGLU's separate gate and up [E, I, H]
            base = k[: -len("gate_up_proj")] + "switch_glu."
            gate, up = mx.split(value, 2, axis=-2)
            out[base + "gate_proj.weight"] = gate
            out[base + "up_proj.weight"] = up
            continue
        if k.endswith(".experts.down_proj"):
            out[k[: -len("down_proj")] + "switch_glu.down_proj.weight"] = value
            continue
        out[k] = value
    return out


def check_weights(model: nn.Module, weights: dict[str, mx.array], model_path: Path) -> None:
    from mlx.utils import tree_flatten

    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensors (e.g. {', '.join(missing[:3])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected tensors (e.g. {', '.join(unexpected[:3])})")
        message = f"weights in {model_path} do not match its config.json: " + "; ".join(parts)
        if any(k.endswith((".qkv_proj.weight", ".gate_up_proj.weight")) and ".switch_glu." not in k for k in unexpected):
            message += (
                ". These files were saved from a model whose projections were merged for running; save "
                "from load(path, merge_projections=False) (or use python -m convert) instead"
            )
        raise CheckpointError(message)
    for k, v in expected.items():
        if v.shape != weights[k].shape:
            raise CheckpointError(
                f"weights in {model_path} do not match its config.json: {k} has shape "
                f"{tuple(weights[k].shape)}, the config implies {tuple(v.shape)}"
            )
