"""How big ``python -m convert`` output is for each variant, computed from the real shapes.

    python -m convert.sizes                      # the README table: bf16, 8-bit and 4-bit (group 64)
    python -m convert.sizes --variants e2b --group-size 32

The model is built from the published config (text decoder, vision tower, and the audio tower of
E2B/E4B) without any weights: MLX arrays are lazy, so the random initial values and their
quantized forms are never computed, only their shapes and dtypes. Quantization goes through the
converter's own :func:`~convert.converter.quantize_model`, so the sizes follow exactly its rules
(8-bit router, PLE table never below 8 bits, towers and norms in float, scales and biases). The
result is the tensor bytes the converter writes; the safetensors JSON headers add well under 1 MB.
"""

from __future__ import annotations

import argparse

from mlx.utils import tree_flatten

from gemma4_mlx.config import ModelConfig
from gemma4_mlx.models import build_model
from gemma4_mlx.variants import VARIANTS, published_config

from .converter import DTYPES, cast_and_quantize

PARTS = ("text", "ple", "vision", "audio")


def _part(key: str) -> str:
    if key.startswith(("vision_tower.", "embed_vision.", "vision_embedder.")):
        return "vision"
    if key.startswith(("audio_tower.", "embed_audio.")):
        return "audio"
    return "ple" if key.startswith("language_model.embed_tokens_per_layer.") else "text"


def converted_bytes(config: dict, **options) -> dict[str, int]:
    """Tensor bytes that ``convert(...)`` with these ``options`` (``dtype``, ``quantize``, ``q_bits``,
    ``q_group_size``, ``q_mode``, ``quant_recipe``, ``quantize_towers``) writes for a checkpoint with
    ``config`` (a ``config.json`` dict), by part: ``text`` (decoder and tied embedding), ``ple`` (the
    per-layer embedding table), ``vision``, ``audio`` (towers with their embedders), and ``total``."""
    model = build_model(ModelConfig.from_dict(config))  # lazy: nothing is allocated
    cast_and_quantize(model, **options)  # the converter's own casting and quantization rules
    sizes = dict.fromkeys(PARTS, 0)
    for key, value in tree_flatten(model.parameters()):
        sizes[_part(key)] += value.nbytes  # from shape and dtype; the array is never evaluated
    sizes["total"] = sum(sizes.values())
    return sizes


def parameter_count(config: dict) -> dict[str, int]:
    """Parameters by part (as in :func:`converted_bytes`), counted on the unquantized model."""
    model = build_model(ModelConfig.from_dict(config))
    counts = dict.fromkeys(PARTS, 0)
    for key, value in tree_flatten(model.parameters()):
        counts[_part(key)] += value.size
    counts["total"] = sum(counts.values())
    return counts


def size_table(variants: list[str] | None = None, group_size: int = 64, dtype: str = "bfloat16") -> str:
    """A Markdown table of converted sizes (GB = 1e9 bytes) for ``dtype``, 8-bit and 4-bit affine."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}")
    rows = [
        f"| variant | parameters | {dtype} | 8-bit | 4-bit | PLE table ({dtype} / 8-bit / 4-bit) | towers (float) |",
        "|---|---|---|---|---|---|---|",
    ]
    gb = lambda n: f"{n / 1e9:.2f} GB"  # noqa: E731
    for name in variants or list(VARIANTS):
        config = published_config(name)
        params = parameter_count(config)
        float_ = converted_bytes(config, dtype=dtype)
        q8 = converted_bytes(config, dtype=dtype, quantize=True, q_bits=8, q_group_size=group_size)
        q4 = converted_bytes(config, dtype=dtype, quantize=True, q_bits=4, q_group_size=group_size)
        ple = f"{gb(float_['ple'])} / {gb(q8['ple'])} / {gb(q4['ple'])}" if params["ple"] else "-"
        parts = "vision + audio" if params["audio"] else "vision"
        if config["model_type"] == "gemma4_unified":
            parts += ", embedders only"  # the 12B has no encoder towers
        towers = f"{gb(float_['vision'] + float_['audio'])} ({parts})"
        rows.append(
            f"| {name} | {params['total'] / 1e9:.2f}B | {gb(float_['total'])} | {gb(q8['total'])} | {gb(q4['total'])} "
            f"| {ple} | {towers} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(prog="python -m convert.sizes", description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    p.add_argument("--group-size", type=int, default=64, choices=(32, 64, 128))
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="dtype of the unquantized weights")
    args = p.parse_args(argv)
    table = size_table(args.variants, args.group_size, args.dtype)
    print(table)
    return table


if __name__ == "__main__":
    main()
