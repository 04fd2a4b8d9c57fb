"""Tiny random Gemma 4 checkpoints written by transformers 5.23 (the numerical reference).

Three shape families cover every variant's code paths:

* ``e2b``: per-layer embeddings, KV sharing, double-wide MLP on shared layers, 4:1 pattern;
* ``moe26b``: MoE beside the dense MLP, K=V full layers with global kv heads, 5:1 pattern;
* ``dense31b``: dense K=V full layers with global kv heads.

Norm weights, layer scalars and router scales are set to random non-trivial values: transformers
initialises them to 1, which would hide a missing or misplaced multiplication.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from gemma4_mlx.testing import media_token_ids, write_tokenizer

VOCAB = 1024  # >= the tiny tokenizer's 721 tokens

# Tiny towers: the small ViT (clipped linears) of E2B/E4B, the large one (standardize) of 26B/31B, audio.
SMALL_VIT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=2, head_dim=16, use_clipped_linears=True, position_embedding_size=128)  # fmt: skip
LARGE_VIT = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=12, standardize=True, position_embedding_size=128)  # fmt: skip
AUDIO = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, subsampling_conv_channels=[128, 4],
             output_proj_dims=48)  # fmt: skip
S, F = "sliding_attention", "full_attention"

FAMILIES = {
    "e2b": dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=10,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        global_head_dim=64,
        layer_types=[S, S, S, S, F] * 2,
        sliding_window=8,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=VOCAB,
        num_kv_shared_layers=4,
        use_double_wide_mlp=True,
    ),
    "moe26b": dict(
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_global_key_value_heads=1,
        head_dim=32,
        global_head_dim=64,
        layer_types=[S] * 5 + [F],
        sliding_window=8,
        hidden_size_per_layer_input=0,
        attention_k_eq_v=True,
        enable_moe_block=True,
        num_experts=8,
        top_k_experts=2,
        moe_intermediate_size=32,
        use_bidirectional_attention="vision",
    ),
    "dense31b": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_global_key_value_heads=1,
        head_dim=32,
        global_head_dim=64,
        layer_types=[S, S, S, F] * 2,
        sliding_window=16,
        hidden_size_per_layer_input=0,
        attention_k_eq_v=True,
        use_bidirectional_attention="vision",
    ),
}


# The 12B unified model's shape family: a dense decoder without PLE, K=V full layers with one
# K/V head (the 12B's), image blocks attended bidirectionally; tiny encoder-free embedders (6912 raw
# values per 48 px patch, 640 per audio frame).
UNIFIED = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    head_dim=32,
    global_head_dim=64,
    layer_types=[S, S, F] * 2,
    sliding_window=8,
)
UNIFIED_VISION = dict(mm_embed_dim=48, output_proj_dims=48, mm_posemb_size=128)
UNIFIED_AUDIO = dict(audio_embed_dim=640)


def text_config(family: str, **overrides) -> dict:
    cfg = dict(
        vocab_size=VOCAB,
        final_logit_softcapping=30.0,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        max_position_embeddings=4096,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=1,
    )
    cfg.update(UNIFIED if family == "unified" else FAMILIES[family])
    cfg.update(overrides)
    return cfg


def build_hf_model(family: str, seed: int = 0, text_only: bool = False, vision_config=None, audio_config=None, **overrides):
    """A random fp32 transformers model of the family, with non-trivial norms and scalars
    (and, with ``vision_config``/``audio_config`` dicts, random towers with finite clip bounds)."""
    from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4TextConfig

    torch.manual_seed(seed)
    tc = text_config(family, **overrides)
    if text_only:
        model = Gemma4ForCausalLM(Gemma4TextConfig(**tc))
    else:
        cfg = Gemma4Config(text_config=tc, vision_config=vision_config, audio_config=audio_config, **media_token_ids())
        model = Gemma4ForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                # Smaller q/k norms keep the scale-1.0 attention away from one-hot softmaxes, where
                # fp32 rounding alone (in transformers too) would dominate the comparison.
                p.copy_(torch.empty_like(p).uniform_(0.25, 0.6, generator=g))
            elif name.endswith("norm.weight") or "layernorm" in name and name.endswith("weight"):
                p.copy_(torch.empty_like(p).uniform_(0.5, 1.5, generator=g))
            elif name.endswith("layer_scalar"):
                p.copy_(torch.empty_like(p).uniform_(0.5, 1.0, generator=g))
            elif name.endswith("router.scale") or name.endswith("per_expert_scale"):
                p.copy_(torch.empty_like(p).uniform_(0.5, 1.5, generator=g))
            elif name.endswith(("input_min", "output_min")):
                p.copy_(torch.empty_like(p).uniform_(-2.0, -1.0, generator=g))
            elif name.endswith(("input_max", "output_max")):
                p.copy_(torch.empty_like(p).uniform_(1.0, 2.0, generator=g))
            elif name.endswith("std_scale"):
                p.copy_(torch.empty_like(p).uniform_(0.5, 1.5, generator=g))
            elif name.endswith("std_bias") or name.endswith("position_embedding_table"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    model.eval()
    model.config._attn_implementation = "eager"
    return model


def build_hf_unified(seed: int = 0, vision_config=UNIFIED_VISION, audio_config=UNIFIED_AUDIO, **overrides):
    """A random fp32 ``Gemma4UnifiedForConditionalGeneration`` (the 12B's shapes, tiny), with
    non-trivial norms, scalars, LayerNorm biases and position embeddings."""
    from transformers import Gemma4UnifiedConfig, Gemma4UnifiedForConditionalGeneration

    torch.manual_seed(seed)
    tc = text_config("unified", **overrides)
    for k in ("vocab_size_per_layer_input",):
        tc.pop(k, None)
    cfg = Gemma4UnifiedConfig(text_config=tc, vision_config=vision_config, audio_config=audio_config, **media_token_ids())
    model = Gemma4UnifiedForConditionalGeneration(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(torch.empty_like(p).uniform_(0.25, 0.6, generator=g))
            elif name.endswith("norm.weight") or (("layernorm" in name or "_ln" in name) and name.endswith("weight")):
                p.copy_(torch.empty_like(p).uniform_(0.5, 1.5, generator=g))
            elif name.endswith("layer_scalar"):
                p.copy_(torch.empty_like(p).uniform_(0.5, 1.0, generator=g))
            elif "embed_vision" in name and name.endswith(("bias", "pos_embedding")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    model.eval()
    model.config._attn_implementation = "eager"
    return model


def save_checkpoint(model, folder: Path, dtype: torch.dtype | None = None, form: str = "transformers", **save_kwargs) -> Path:
    """save_pretrained + tokenizer files; ``form="published"`` rewrites config.json as Google ships it."""
    folder = Path(folder)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(str(folder), **save_kwargs)
    write_tokenizer(folder, vocab_size=VOCAB)
    if form == "published":
        to_published_form(folder / "config.json")
    return folder


def to_published_form(config_path: Path) -> None:
    """Replace 5.23's ``per_layer_config`` by ``global_head_dim``/``num_global_key_value_heads``,
    with ``vocab_size`` only inside ``text_config``, as in the published checkpoints."""
    raw = json.loads(config_path.read_text())
    text = raw.get("text_config", raw)
    per_layer = text.pop("per_layer_config")
    full = next(iter(per_layer.values()))
    text["global_head_dim"] = full["head_dim"]
    if "num_key_value_heads" in full:
        text["num_global_key_value_heads"] = full["num_key_value_heads"]
    if "text_config" in raw:
        raw.pop("vocab_size", None)
    config_path.write_text(json.dumps(raw, indent=2))


def dequantized_reference(path, src):
    """The float model of ``src`` with every quantized weight of the folder at ``path`` dequantized:
    what a quantized model must compute, up to float rounding."""
    import mlx.core as mx

    from gemma4_mlx import load_model

    # Both under the checkpoint's names (the projections merged afterwards, as loading does).
    model = load_model(path, lazy_ple=False, merge_projections=False)
    flat = load_model(src, dtype="float32", lazy_ple=False, merge_projections=False)
    weights = []
    for name, m in model.named_modules():
        if "scales" in m:
            w = mx.dequantize(m.weight, m.scales, m.get("biases"), group_size=m.group_size, bits=m.bits, mode=m.mode)
            weights.append((name + ".weight", w.astype(mx.float32)))
    assert weights
    flat.load_weights(weights, strict=False)
    flat.merge_projections()
    return flat


def allow_hf_assistants() -> None:
    """transformers 5.23 cannot build a Gemma 4 assistant: ``Gemma4TextConfig.kv_sharing_modes``
    (and the unified model's copy of it) raises when every layer is KV-shared (no layer produces
    K/V), which is exactly the assistant's layout. Here such a config says "reuse" for every layer,
    what the assistant's code expects."""
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig
    from transformers.models.gemma4_unified.configuration_gemma4_unified import Gemma4UnifiedTextConfig

    for config_class in (Gemma4TextConfig, Gemma4UnifiedTextConfig):
        original = config_class.kv_sharing_modes
        if getattr(original.fget, "allows_assistants", False):
            continue

        def kv_sharing_modes(self, original=original):
            if self.num_kv_shared_layers == self.num_hidden_layers:
                return ["reuse"] * self.num_hidden_layers
            return original.fget(self)

        kv_sharing_modes.allows_assistants = True
        config_class.kv_sharing_modes = property(kv_sharing_modes)


def build_hf_assistant(family: str, ordered: bool = False, seed: int = 0, **overrides):
    """A random fp32 ``Gemma4AssistantForCausalLM`` (``Gemma4UnifiedAssistantForCausalLM`` for the
    unified family) for a target of ``family``: 4 layers (3 sliding,
    1 full) whose heads read the family's K/V, a narrower width, and with ``ordered`` the
    centroid-sparse head (8 centroids of 128 tokens, top 2, a random token ordering)."""
    from transformers import (Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4UnifiedAssistantConfig,
                              Gemma4UnifiedAssistantForCausalLM)  # fmt: skip

    allow_hf_assistants()
    torch.manual_seed(seed)
    target = text_config(family)
    keep = ("num_key_value_heads", "head_dim", "global_head_dim", "sliding_window", "attention_k_eq_v", "num_global_key_value_heads")
    tc = text_config(family, hidden_size=48, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                     layer_types=[S, S, S, F], hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
                     use_double_wide_mlp=False, enable_moe_block=False, num_kv_shared_layers=4,
                     **{k: target[k] for k in keep if k in target})  # fmt: skip
    for k in ("num_experts", "top_k_experts", "moe_intermediate_size"):
        tc.pop(k, None)
    tc.update(overrides)
    unified = family == "unified"  # the 12B's drafter: gemma4_unified_assistant, a unified text config
    if unified:
        for k in ("hidden_size_per_layer_input", "vocab_size_per_layer_input", "enable_moe_block"):
            tc.pop(k)
    config_class, model_class = (Gemma4UnifiedAssistantConfig, Gemma4UnifiedAssistantForCausalLM) if unified else (Gemma4AssistantConfig, Gemma4AssistantForCausalLM)
    config = config_class(text_config=tc, backbone_hidden_size=target["hidden_size"], use_ordered_embeddings=ordered,
                          num_centroids=8, centroid_intermediate_top_k=2)  # fmt: skip
    model = model_class(config)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("q_norm.weight"):
                p.copy_(torch.empty_like(p).uniform_(0.25, 0.6, generator=g))
            elif name.endswith("norm.weight") or "layernorm" in name and name.endswith("weight"):
                p.copy_(torch.empty_like(p).uniform_(0.5, 1.5, generator=g))
            elif name.endswith("layer_scalar"):
                p.copy_(torch.empty_like(p).uniform_(0.5, 1.0, generator=g))
        if ordered:
            model.masked_embedding.token_ordering.copy_(torch.randperm(VOCAB, generator=g))
    model.eval()
    model.config._attn_implementation = "eager"
    return model
