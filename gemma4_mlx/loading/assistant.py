"""Loading Gemma 4 assistants (drafters): ``load_drafter("google/gemma-4-E2B-it-assistant")``.

Reads transformers' ``Gemma4AssistantForCausalLM`` folders and the ones ``python -m convert``
writes from them (optionally quantized), locally or from the Hub. Parameter names are the
checkpoint's: the :class:`~gemma4_mlx.models.assistant.Assistant` module tree mirrors transformers'.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from ..config import read_json
from ..errors import ConfigError, UnsupportedModelError
from ..models.assistant import Assistant, AssistantConfig
from .checkpoint import check_weights, read_weights, weight_files
from .hub import resolve_model_path
from .quantization import quantize_like_checkpoint


def load_drafter_config(model_path: Path) -> AssistantConfig:
    path = model_path / "config.json"
    raw = read_json(path, what="a model config", missing=f"no config.json in {model_path}: is this a model folder?")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a JSON object, not {type(raw).__name__}")
    try:
        return AssistantConfig.from_dict(raw)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    except UnsupportedModelError as e:  # e.g. a Gemma 4 model given where its assistant was meant
        raise UnsupportedModelError(f"{model_path}: {e}") from None


def load_drafter(path_or_repo_id: str | Path, dtype: str | None = None, revision: str | None = None) -> Assistant:
    """A Gemma 4 assistant from a local folder or a Hub repo id (see the module docstring)."""
    from . import _cast

    model_path = resolve_model_path(path_or_repo_id, revision=revision)
    config = load_drafter_config(model_path)
    model = Assistant(config)
    weights = _cast(read_weights(weight_files(model_path)), dtype)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # tied to model.embed_tokens
    if "masked_embedding.token_ordering" in weights:  # int64 in transformers' files
        weights["masked_embedding.token_ordering"] = weights["masked_embedding.token_ordering"].astype(mx.int32)
    if config.quantization:  # the drafter's module names are the checkpoint's: no renaming
        quantize_like_checkpoint(model, config.quantization, weights, names=str)
    check_weights(model, weights, model_path)
    model.load_weights(list(weights.items()), strict=True)
    model.materialize()
    model.eval()
    return model


__all__ = ["load_drafter", "load_drafter_config"]
