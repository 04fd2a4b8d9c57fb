"""Loading Gemma 4 checkpoints: local folders, Hub repo ids, HF and MLX layouts.

``load(path_or_repo_id)`` returns ``(model, processor)``. It accepts

* an original Hugging Face checkpoint folder (``Gemma4ForConditionalGeneration``, the text-only
  ``Gemma4ForCausalLM``, or the 12B's ``Gemma4UnifiedForConditionalGeneration``), single-file or
  sharded with ``model.safetensors.index.json``;
* a folder written by ``python -m convert`` (optionally quantized: ``config.json`` has a
  ``quantization`` section), or by mlx-vlm's or mlx-lm's converters;
* a Hub repo id, downloaded with ``huggingface_hub.snapshot_download``.

Its parts: :mod:`.hub` (folders and Hub ids), :mod:`.checkpoint` (weight files and names),
:mod:`.quantization` (quantization rules), :mod:`.ple` (the memory-mapped per-layer table).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import mlx.core as mx

from ..config import ModelConfig
from ..errors import CheckpointError, ConfigError, UnsupportedModelError
from ..models import Gemma4Model, build_model
from .checkpoint import check_weights, read_weights, rename, sanitize, weight_files
from .hub import resolve_model_path
from .quantization import quantize_like_checkpoint

DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}
PLE = "language_model.embed_tokens_per_layer"


def load_config(model_path: Path) -> ModelConfig:
    return ModelConfig.from_file(model_path / "config.json")


def load_model(
    model_path: str | Path, dtype: str | None = None, lazy: bool = False, lazy_ple: bool = True, merge_projections: bool = True,
    stage=None, shard=None,
) -> Gemma4Model:
    """Build the model from a local checkpoint folder and load its weights.

    ``dtype`` casts floating-point weights ("bfloat16", "float16", "float32"); by default the
    checkpoint's own dtype is kept. With ``lazy=True`` weights are read from disk on first use.
    With ``lazy_ple=True`` (E2B/E4B) the per-layer-embedding table stays on disk, memory-mapped,
    and only the rows of the tokens processed are read (see :mod:`.ple`); ``lazy_ple=False`` loads
    it into memory (4.7 GB for E2B in bf16) for slightly faster lookups. ``merge_projections``
    runs each layer's q/k/v and gate/up as one matmul (:meth:`Gemma4Model.merge_projections`);
    pass False to get the checkpoint's parameter names back (to save or modify weights).
    ``stage`` (a :class:`~gemma4_mlx.distributed.pipeline.PipelineStage`) keeps only this process's
    part of a pipeline, and reads only its weights; ``shard(model)``, called once the weights are in
    and before projections merge, splits the layers (tensor parallelism).
    """
    model_path = Path(model_path).expanduser().absolute()
    if not model_path.is_dir():
        raise FileNotFoundError(f"model folder not found: {model_path}")
    config = load_config(model_path)
    try:
        model = build_model(config)
    except ConfigError as e:  # a tower config with a field of the wrong type
        raise ConfigError(f"{model_path / 'config.json'}: {e}") from None
    files = weight_files(model_path, keep=stage.keeps if stage is not None else None)
    weights = _cast(sanitize(read_weights(files), config), dtype)
    if stage is not None:
        model.use_pipeline(stage)
        weights = {k: v for k, v in weights.items() if stage.keeps(k)}  # the rest is never read
    if lazy_ple and "embed_tokens_per_layer" in model.language_model:
        _map_ple_table(model, config, files, weights, dtype, model_path)
    for tower in ("vision_tower", "audio_tower"):
        if tower in model:  # the towers' own name fix-ups, on names relative to the tower
            prefix = tower + "."
            own = model[tower].sanitize({k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)})
            weights = {k: v for k, v in weights.items() if not k.startswith(prefix)}
            weights.update({prefix + k: v for k, v in own.items()})
    if config.quantization:
        quantize_like_checkpoint(model, config.quantization, weights)
    check_weights(model, weights, model_path)
    model.load_weights(list(weights.items()), strict=True)
    if shard is not None:
        shard(model)
    adapt_to_device(model)
    if merge_projections:
        model.merge_projections()
    if not lazy:
        model.materialize()
    model.eval()
    return model


def _cast(weights: dict[str, mx.array], dtype: str | None) -> dict[str, mx.array]:
    """Floating-point weights to ``dtype`` (quantization scales and biases keep theirs)."""
    if dtype is None:
        return weights
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
    target = DTYPES[dtype]
    return {
        k: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) and not k.endswith((".scales", ".biases")) else v
        for k, v in weights.items()
    }


def _map_ple_table(model: Gemma4Model, config: ModelConfig, files: list[Path], weights: dict, dtype, model_path: Path) -> None:
    """Give the model the E2B/E4B per-layer table memory-mapped from its file, instead of loading it,
    and drop it from ``weights`` (affine-quantized or float tables; others are loaded as usual)."""
    quantization = config.quantization or {}
    # The table's own override decides (our converter keeps it affine 8-bit under mxfp4 too).
    ple_quant = next((v for k, v in quantization.items() if isinstance(v, dict) and rename(k) == PLE), {})
    mode = ple_quant.get("mode", quantization.get("mode", "affine"))
    if f"{PLE}.weight" not in weights or (f"{PLE}.scales" in weights and mode != "affine"):
        return
    from .ple import PLE_KEYS, map_ple_table

    tc = config.text_config
    mapped = map_ple_table(files, PLE_KEYS, dtype=DTYPES[dtype] if dtype else None, dims=tc.num_hidden_layers * tc.hidden_size_per_layer_input)
    if mapped is None:
        return
    if mapped.shape[0] != tc.vocab_size_per_layer_input:
        raise CheckpointError(
            f"weights in {model_path} do not match its config.json: {PLE}.weight has "
            f"{mapped.shape[0]} rows, the config implies {tc.vocab_size_per_layer_input}"
        )
    for suffix in (".weight", ".scales", ".biases"):
        weights.pop(PLE + suffix, None)  # never read: mx.load's arrays are lazy
    model.language_model.use_mapped_ple(mapped)


def adapt_to_device(model: Gemma4Model) -> None:
    """Work around limits of the current device's backend: MLX's CPU backend runs the experts'
    ``gather_mm`` only in float32, so unquantized half-precision experts are upcast there (Metal and
    CUDA run them in any dtype)."""
    if mx.default_device().type != mx.DeviceType.cpu:
        return
    changed = False
    for layer in model.layers:
        if layer is None or not layer.has_moe:
            continue
        glu = layer.experts.switch_glu
        for proj in (glu.gate_proj, glu.up_proj, glu.down_proj):
            if "scales" not in proj and proj.weight.dtype != mx.float32:
                proj.weight = proj.weight.astype(mx.float32)
                changed = True
    if changed:
        warnings.warn("MLX's CPU backend needs float32 experts: half-precision expert weights were upcast")


def load(
    path_or_repo_id: str | Path,
    dtype: str | None = None,
    lazy: bool = False,
    revision: str | None = None,
    lazy_ple: bool = True,
    merge_projections: bool = True,
):
    """Load a Gemma 4 checkpoint: ``model, processor = load("google/gemma-4-E2B-it")``.

    ``path_or_repo_id`` is a local folder (HF original or converted) or a Hub repo id.
    ``lazy_ple`` keeps the E2B/E4B per-layer-embedding table memory-mapped on disk, and
    ``merge_projections`` runs q/k/v and gate/up as one matmul each (see ``load_model``).
    """
    from ..processing.processor import Processor

    model_path = resolve_model_path(path_or_repo_id, revision=revision)
    model = load_model(model_path, dtype=dtype, lazy=lazy, lazy_ple=lazy_ple, merge_projections=merge_projections)
    processor = Processor.from_pretrained(model_path, model.config)
    return model, processor


__all__ = ["load", "load_model", "load_config", "adapt_to_device", "resolve_model_path", "rename", "sanitize", "CheckpointError", "UnsupportedModelError"]
