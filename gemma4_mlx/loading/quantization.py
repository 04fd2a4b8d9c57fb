"""Quantization rules in one place: which modules the converter quantizes, at which bits (used by
``python -m convert``, ``convert.sizes`` and the benchmarks), and how a quantized checkpoint is
mapped back onto the model when it is loaded."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .checkpoint import rename

MODES = {"affine": (2, 3, 4, 5, 6, 8), "mxfp4": (4,), "mxfp8": (8,)}  # bits each mode supports
RECIPES = ("mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6", "mixed_4_8")
# Kept in float unless asked (--quantize-towers): encoders and embedders that read raw pixels or
# samples, where a quantization error is never corrected downstream; they are small beside the decoder.
TOWERS = ("vision_tower", "audio_tower", "embed_vision", "embed_audio", "vision_embedder")


@dataclass
class QuantizationPlan:
    """How each module is quantized: defaults plus per-module overrides (mlx-lm's config format)."""

    bits: int
    group_size: int
    mode: str
    recipe: str | None = None
    towers: bool = False
    overrides: dict[str, dict] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def config(self) -> dict:
        return {"group_size": self.group_size, "bits": self.bits, "mode": self.mode, **self.overrides}


def _more_bits(layer: int, n: int) -> bool:
    """llama.cpp's Q4_K_M choice (as in mlx-lm's mixed recipes): first and last eighth, every third."""
    return layer < n // 8 or layer >= 7 * n // 8 or (layer - n // 8) % 3 == 2


def quantize_model(model: nn.Module, plan: QuantizationPlan) -> QuantizationPlan:
    """Quantize ``model`` in place following ``plan``; fills ``plan.overrides`` and ``plan.notes``."""
    n_layers = len(model.layers)
    low, high = (int(b) for b in plan.recipe.split("_")[1:]) if plan.recipe else (plan.bits, plan.bits)
    default = {"group_size": plan.group_size, "bits": low, "mode": plan.mode}
    eight_bit = {"group_size": 64, "bits": 8, "mode": "affine"}

    def predicate(path: str, module: nn.Module):
        if not hasattr(module, "to_quantized"):
            return False  # norms, scalars, convolutions, position tables stay in float
        if path.startswith(TOWERS) and not plan.towers:
            return False
        if path.endswith("embed_tokens_per_layer"):
            # 4-bit PLE tables are known to ruin real E2B/E4B models: never below 8 bits.
            choice = eight_bit if low < 8 else default
        elif path.endswith("router.proj"):
            choice = eight_bit  # routing decisions are sensitive; the router is tiny
        elif plan.recipe and re.search(r"\.(v_proj|down_proj)$", path) and (m := re.search(r"layers\.(\d+)\.", path)):
            choice = {**default, "bits": high} if _more_bits(int(m.group(1)), n_layers) else default
        elif plan.recipe and path.endswith("embed_tokens"):
            choice = {**default, "bits": high}  # the tied LM head
        else:
            choice = default
        in_dims = module.weight.shape[-1]
        if in_dims % choice["group_size"]:
            plan.notes.append(f"{path}: input size {in_dims} is not a multiple of {choice['group_size']}; kept in float")
            return False
        if choice != {"group_size": plan.group_size, "bits": plan.bits, "mode": plan.mode}:
            plan.overrides[path] = choice
        return choice

    nn.quantize(model, group_size=plan.group_size, bits=plan.bits, mode=plan.mode, class_predicate=predicate)
    return plan



def quantize_like_checkpoint(model: nn.Module, quantization: dict[str, Any], weights: dict[str, mx.array], names=rename) -> None:
    """Swap in quantized layers wherever the checkpoint holds quantized weights (mlx-lm format).

    Per-module overrides in ``quantization`` are keyed by the writer's module names (ours,
    mlx-vlm's ``language_model.model.*`` or mlx-lm's ``model.*``): ``names`` maps them to ours
    (the default, :func:`rename`, knows the Gemma 4 layouts).
    """
    overrides = {names(k): v for k, v in quantization.items() if isinstance(v, dict)}

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
