"""Loading Gemma 4 checkpoints: local folders, Hub repo ids, HF and MLX layouts.

``load(path_or_repo_id)`` returns ``(model, processor)``. It accepts

* an original Hugging Face checkpoint folder (``Gemma4ForConditionalGeneration`` or the text-only
  ``Gemma4ForCausalLM``), single-file or sharded with ``model.safetensors.index.json``;
* a folder written by ``python -m convert`` (optionally quantized: ``config.json`` has a
  ``quantization`` section);
* a Hub repo id, downloaded with ``huggingface_hub.snapshot_download``.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from .config import ModelConfig, read_json_object
from .errors import CheckpointError, ConfigError, UnsupportedModelError
from .model import Gemma4Model

_DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}

# What a checkpoint folder needs; anything else in a Hub repo (original/ PyTorch files, GGUF...) is skipped.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.md"]

# Tower weights belong to the multimodal encoders; the text model ignores them.
_TOWER_PREFIXES = ("vision_tower.", "audio_tower.", "embed_vision.", "embed_audio.", "multi_modal_projector.")


def resolve_model_path(
    path_or_repo_id: str | Path, revision: str | None = None, progress: Callable[[str], None] | None = None
) -> Path:
    """A local folder as is, or a Hub repo id downloaded (or found in the cache) with huggingface_hub.

    ``progress``, if given, receives huggingface_hub's progress bars as text while downloading
    (the app shows them in the page); they still print to the terminal as usual."""
    path = Path(path_or_repo_id).expanduser()
    if path.is_dir():
        # Absolute, so that paths built from it stay right whatever the working directory is later.
        return path.absolute()
    if path.exists():
        raise FileNotFoundError(f"{path} is a file; pass the model folder that holds config.json")
    text = str(path_or_repo_id)
    looks_like_repo = re.fullmatch(r"[\w.-]+/[\w.-]+", text) is not None and not text.startswith((".", "/", "~"))
    if not looks_like_repo:
        raise FileNotFoundError(f"model folder not found: {path}")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        tqdm_class = _reporting_tqdm(progress) if progress is not None else None
        return Path(snapshot_download(text, revision=revision, allow_patterns=_HUB_PATTERNS, tqdm_class=tqdm_class))
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"{text!r} is neither a local folder nor a Hub repository") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        raise FileNotFoundError(
            f"could not download {text!r} from the Hugging Face Hub and it is not in the local cache ({e})"
        ) from None


def _reporting_tqdm(progress: Callable[[str], None]):
    """A tqdm class that also hands each refreshed bar to ``progress`` as one line of text.

    huggingface_hub takes a ``tqdm_class`` for its byte counters; it has no callback of its own.
    Built on huggingface_hub's tqdm, so that ``HF_HUB_DISABLE_PROGRESS_BARS`` still applies."""
    from huggingface_hub.utils import tqdm

    class ReportingTqdm(tqdm):
        def display(self, msg=None, pos=None):
            try:
                progress(str(self).strip())
            except Exception:  # a failing reporter must not break the download
                pass
            return super().display(msg, pos)

    return ReportingTqdm


def load_config(model_path: Path) -> ModelConfig:
    return ModelConfig.from_file(model_path / "config.json")


def _shard_name(index: Path, name: Any) -> str:
    """A shard file name from an index, refused unless it names a file inside the model folder."""
    if not isinstance(name, str) or not name.endswith(".safetensors"):
        raise CheckpointError(f"{index} is not a valid safetensors index: {name!r} is not a .safetensors file name")
    parts = PurePosixPath(name.replace("\\", "/")).parts
    if not parts or PurePosixPath(name).is_absolute() or Path(name).is_absolute() or ".." in parts:
        raise CheckpointError(f"{index} names the shard {name!r}, which is outside the model folder; refusing to load it")
    return name


def weight_files(model_path: Path) -> list[Path]:
    """The safetensors files of a checkpoint, from its index if it has one (names that would leave
    the folder, such as ``../x.safetensors`` or absolute paths, are refused)."""
    index = model_path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = read_json_object(index, "a safetensors index")["weight_map"]
        except (ConfigError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index ({e})") from None
        if not isinstance(weight_map, dict) or not weight_map:
            kind = type(weight_map).__name__ if not isinstance(weight_map, dict) else "an empty object"
            raise CheckpointError(f"{index} is not a valid safetensors index: its weight_map is {kind}, not a tensor -> file map")
        files = [model_path / _shard_name(index, name) for name in sorted(set(map(str, weight_map.values())))]
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
        return rest if rest.startswith(_TOWER_PREFIXES) else "language_model." + rest
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
        if k.startswith(_TOWER_PREFIXES):
            tower = k.split(".", 1)[0]
            if (tower in ("vision_tower", "embed_vision") and config.vision_config) or (
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


def _quantize_like_checkpoint(model: nn.Module, quantization: dict[str, Any], weights: dict[str, mx.array]) -> None:
    """Swap in quantized layers wherever the checkpoint holds quantized weights (mlx-lm format).

    Per-module overrides in ``quantization`` are keyed by the writer's module names (ours,
    mlx-vlm's ``language_model.model.*`` or mlx-lm's ``model.*``): they are renamed to ours first.
    """
    overrides = {rename(k): v for k, v in quantization.items() if isinstance(v, dict)}

    def predicate(path: str, module: nn.Module):
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return overrides.get(path, True)

    nn.quantize(
        model,
        group_size=quantization.get("group_size", 64),
        bits=quantization.get("bits", 4),
        mode=quantization.get("mode", "affine"),
        class_predicate=predicate,
    )


def load_model(model_path: str | Path, dtype: str | None = None, lazy: bool = False, lazy_ple: bool = True) -> Gemma4Model:
    """Build the model from a local checkpoint folder and load its weights.

    ``dtype`` casts floating-point weights ("bfloat16", "float16", "float32"); by default the
    checkpoint's own dtype is kept. With ``lazy=True`` weights are read from disk on first use.
    With ``lazy_ple=True`` (E2B/E4B) the per-layer-embedding table stays on disk, memory-mapped,
    and only the rows of the tokens processed are read (see :mod:`gemma4_mlx.ple`);
    ``lazy_ple=False`` loads it into memory (4.7 GB for E2B in bf16) for slightly faster lookups.
    """
    model_path = Path(model_path).expanduser().absolute()
    if not model_path.is_dir():
        raise FileNotFoundError(f"model folder not found: {model_path}")
    config = load_config(model_path)
    try:
        model = Gemma4Model(config)
    except ConfigError as e:  # a tower config with a field of the wrong type
        raise ConfigError(f"{model_path / 'config.json'}: {e}") from None
    files = weight_files(model_path)
    weights = sanitize(read_weights(files), config)
    if dtype is not None:
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, not {dtype!r}")
        target = _DTYPES[dtype]
        weights = {
            k: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) and not k.endswith((".scales", ".biases")) else v
            for k, v in weights.items()
        }
    ple = "language_model.embed_tokens_per_layer"
    quantization = config.quantization or {}
    # The table's own override decides (our converter keeps it affine 8-bit under mxfp4 too).
    ple_quant = next((v for k, v in quantization.items() if isinstance(v, dict) and rename(k) == ple), {})
    quant_mode = ple_quant.get("mode", quantization.get("mode", "affine"))
    if lazy_ple and f"{ple}.weight" in weights and (f"{ple}.scales" not in weights or quant_mode == "affine"):
        from .ple import PLE_KEYS, map_ple_table

        tc = config.text_config
        mapped = map_ple_table(
            files, PLE_KEYS, dtype=_DTYPES[dtype] if dtype else None,
            dims=tc.num_hidden_layers * tc.hidden_size_per_layer_input,
        )  # fmt: skip
        if mapped is not None:
            if mapped.shape[0] != tc.vocab_size_per_layer_input:
                raise CheckpointError(
                    f"weights in {model_path} do not match its config.json: {ple}.weight has "
                    f"{mapped.shape[0]} rows, the config implies {tc.vocab_size_per_layer_input}"
                )
            for suffix in (".weight", ".scales", ".biases"):
                weights.pop(ple + suffix, None)  # never read: mx.load's arrays are lazy
            model.language_model.use_mapped_ple(mapped)
    for tower in ("vision_tower", "audio_tower"):
        if tower in model:
            prefix = tower + "."
            own = {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}
            weights = {k: v for k, v in weights.items() if not k.startswith(prefix)}
            module = model[tower]
            own = module.sanitize(own, module.config) if tower == "vision_tower" else module.sanitize(own)
            weights.update({prefix + k: v for k, v in own.items()})
    if config.quantization:
        _quantize_like_checkpoint(model, config.quantization, weights)
    _check_weights(model, weights, model_path)
    model.load_weights(list(weights.items()), strict=True)
    model.adapt_to_device()
    if not lazy:
        model.materialize()
    model.eval()
    return model


def _check_weights(model: nn.Module, weights: dict[str, mx.array], model_path: Path) -> None:
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
        raise CheckpointError(f"weights in {model_path} do not match its config.json: " + "; ".join(parts))
    for k, v in expected.items():
        if v.shape != weights[k].shape:
            raise CheckpointError(
                f"weights in {model_path} do not match its config.json: {k} has shape "
                f"{tuple(weights[k].shape)}, the config implies {tuple(v.shape)}"
            )


def load(
    path_or_repo_id: str | Path,
    dtype: str | None = None,
    lazy: bool = False,
    revision: str | None = None,
    lazy_ple: bool = True,
):
    """Load a Gemma 4 checkpoint: ``model, processor = load("google/gemma-4-E2B-it")``.

    ``path_or_repo_id`` is a local folder (HF original or converted) or a Hub repo id.
    ``lazy_ple`` keeps the E2B/E4B per-layer-embedding table memory-mapped on disk (see ``load_model``).
    """
    from .processing import Processor

    model_path = resolve_model_path(path_or_repo_id, revision=revision)
    model = load_model(model_path, dtype=dtype, lazy=lazy, lazy_ple=lazy_ple)
    processor = Processor.from_pretrained(model_path, model.config)
    return model, processor


__all__ = ["load", "load_model", "load_config", "resolve_model_path", "rename", "sanitize", "CheckpointError", "UnsupportedModelError"]
