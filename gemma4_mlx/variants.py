"""The published shapes of every Gemma 4 model: what the benchmarks, the size table, the memory
planner and the tests build when they need a real variant without its weights.

``VARIANTS`` holds the parts of each text config that shape compute and memory; towers are the
published vision and audio configs (reference/GEMMA4.md; the fields it does not list are
transformers 5.23's defaults, which are the published values).
"""

from __future__ import annotations

from .config import FULL, SLIDING

S, F = SLIDING, FULL

# Published text configs (the parts that shape compute and memory).
VARIANTS = {
    "e2b": dict(
        hidden_size=1536, intermediate_size=6144, num_hidden_layers=35, layer_types=[S, S, S, S, F] * 7,
        num_attention_heads=8, num_key_value_heads=1, head_dim=256, global_head_dim=512,
        num_kv_shared_layers=20, hidden_size_per_layer_input=256, use_double_wide_mlp=True, sliding_window=512,
        max_position_embeddings=131_072,
    ),
    "e4b": dict(
        hidden_size=2560, intermediate_size=10240, num_hidden_layers=42, layer_types=([S] * 5 + [F]) * 7,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, global_head_dim=512,
        num_kv_shared_layers=18, hidden_size_per_layer_input=256, use_double_wide_mlp=True, sliding_window=512,
        max_position_embeddings=131_072,
    ),
    # The 12B unified model's decoder: dense, no PLE, K=V full layers with a single K/V head.
    "12b": dict(
        hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, layer_types=([S] * 5 + [F]) * 8,
        num_attention_heads=16, num_key_value_heads=8, num_global_key_value_heads=1, head_dim=256, global_head_dim=512,
        attention_k_eq_v=True, hidden_size_per_layer_input=0, sliding_window=1024, max_position_embeddings=262_144,
    ),
    "26b-a4b": dict(
        hidden_size=2816, intermediate_size=2112, num_hidden_layers=30, layer_types=([S] * 5 + [F]) * 5,
        num_attention_heads=16, num_key_value_heads=8, num_global_key_value_heads=2, head_dim=256, global_head_dim=512,
        attention_k_eq_v=True, enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=704,
        hidden_size_per_layer_input=0, sliding_window=1024, max_position_embeddings=262_144,
    ),
    "31b": dict(
        hidden_size=5376, intermediate_size=21504, num_hidden_layers=60, layer_types=([S] * 5 + [F]) * 10,
        num_attention_heads=32, num_key_value_heads=16, num_global_key_value_heads=4, head_dim=256, global_head_dim=512,
        attention_k_eq_v=True, hidden_size_per_layer_input=0, sliding_window=1024, max_position_embeddings=262_144,
    ),
}


def variant_config(name: str, layers: int | None = None, vocab_size: int = 262_144) -> dict:
    """The variant's text config, cut to ``layers`` layers (whole pattern periods, KV sharing kept)."""
    # Every field spelled out: mlx-lm's defaults are E2B's (KV sharing, double-wide MLP).
    defaults = dict(
        vocab_size=vocab_size, vocab_size_per_layer_input=vocab_size, final_logit_softcapping=30.0,
        num_kv_shared_layers=0, use_double_wide_mlp=False, attention_k_eq_v=False, enable_moe_block=False,
    )
    cfg = {**defaults, **VARIANTS[name]}
    n = cfg["num_hidden_layers"]
    if layers is not None and layers < n:
        period = cfg["layer_types"].index(F) + 1
        shared = cfg["num_kv_shared_layers"]
        if shared:
            # Keep the share of KV-shared layers, but leave one whole period of layers that own K/V.
            keep = max(2 * period, layers // period * period)
            cfg["num_kv_shared_layers"] = min(round(shared * keep / n), keep - period)
            cfg["layer_types"] = cfg["layer_types"][:keep]
        elif layers < period:
            # Less than one period: sliding layers then one full layer, so both kinds are measured.
            cfg["layer_types"] = [S] * (max(layers, 2) - 1) + [F]
        else:
            cfg["layer_types"] = cfg["layer_types"][: layers // period * period]
        cfg["num_hidden_layers"] = len(cfg["layer_types"])
    return cfg


# Published towers: the small ViT of E2B/E4B, the large one of 26B-A4B/31B, the audio Conformer.
SMALL_VIT = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=12,
                 num_key_value_heads=12, head_dim=64, use_clipped_linears=True)  # fmt: skip
LARGE_VIT = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                 num_key_value_heads=16, head_dim=72, standardize=True)  # fmt: skip
AUDIO = dict(hidden_size=1024, num_hidden_layers=12, num_attention_heads=8, subsampling_conv_channels=[128, 32],
             output_proj_dims=1536, use_clipped_linears=True)  # fmt: skip
# The 12B's encoder-free embedders: 48 px patches (16 px merged 3x3) into 3840 dims with a
# 1120-row position table per axis; raw 640-sample (40 ms) audio frames.
UNIFIED_VISION = dict(patch_size=16, pooling_kernel_size=3, mm_embed_dim=3840, mm_posemb_size=1120, output_proj_dims=3840)
UNIFIED_AUDIO = dict(audio_embed_dim=640)


def published_config(name: str) -> dict:
    """The whole ``config.json`` of a variant (``e2b``, ``e4b``, ``12b``, ``26b-a4b``, ``31b``), towers included."""
    if name == "12b":
        text = {k: v for k, v in variant_config(name).items() if k not in ("vocab_size_per_layer_input", "enable_moe_block")}
        return {"model_type": "gemma4_unified", "text_config": text, "vision_config": dict(UNIFIED_VISION), "audio_config": dict(UNIFIED_AUDIO)}
    small = name in ("e2b", "e4b")
    return {
        "model_type": "gemma4",
        "text_config": variant_config(name),
        "vision_config": dict(SMALL_VIT if small else LARGE_VIT),
        "audio_config": dict(AUDIO) if small else None,
    }
