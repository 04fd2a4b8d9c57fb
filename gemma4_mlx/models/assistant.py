"""The Gemma 4 assistant: the small drafter Google ships beside each Gemma 4 model for multi-token
prediction (``google/gemma-4-*-it-assistant``; transformers' ``Gemma4AssistantForCausalLM``).

It has no cache and no prefill of its own. Its input is the target's (scaled) embedding of the last
seen token beside the target's last (normed) hidden state; every one of its layers attends to the
target's K/V, the sliding layers to the target's last sliding layer's, the full layers to its last
full layer's, at the constant position of that last seen token. Each step returns logits and a
hidden state projected back to the target's width, which is the next step's second input.

The E2B/E4B drafters rank tokens with a centroid-sparse head (``use_ordered_embeddings``): only the
tokens of the top centroids get logits, the rest get the minimum minus one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .. import ops
from ..config import FULL, SLIDING, TextConfig, UnsupportedModelError, split_known_keys, unified_text_config
from ..errors import ConfigError, DrafterMismatchError
from .text import DecoderLayer, materialize

TARGET = -1  # kv_source of a drafter layer: the target model's K/V
# transformers' Gemma4UnifiedAssistantForCausalLM (the 12B's drafter) is Gemma4AssistantForCausalLM unchanged.
ASSISTANT_MODEL_TYPES = ("gemma4_assistant", "gemma4_unified_assistant")


@dataclass
class AssistantConfig:
    """``config.json`` of a ``gemma4_assistant`` checkpoint."""

    text_config: TextConfig
    backbone_hidden_size: int = 1536
    use_ordered_embeddings: bool = False
    num_centroids: int = 2048
    centroid_intermediate_top_k: int = 32
    tie_word_embeddings: bool = True
    model_type: str = "gemma4_assistant"
    quantization: dict[str, Any] | None = None
    extra: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "AssistantConfig":
        model_type = raw.get("model_type")
        if model_type not in ASSISTANT_MODEL_TYPES:
            raise UnsupportedModelError(f"not a Gemma 4 assistant checkpoint (model_type {model_type!r})")
        if not isinstance(raw.get("text_config"), dict):
            raise ConfigError(f"a {model_type} config.json needs a text_config")
        text = dict(raw["text_config"])
        if model_type == "gemma4_unified_assistant":  # the 12B's drafter: the same model, unified text defaults
            text = unified_text_config({k: v for k, v in text.items() if k != "model_type"})
        # Every drafter layer reads the target's K/V; resolved here as layers of their own (see
        # layer_specs), so the text config is read as if none were shared.
        text["num_kv_shared_layers"] = 0
        text.setdefault("hidden_size_per_layer_input", 0)
        rest = {k: v for k, v in raw.items() if k not in ("text_config", "quantization_config")}
        rest.setdefault("quantization", raw.get("quantization_config"))
        known, extra = split_known_keys(cls, rest, "config.json")
        return cls(text_config=TextConfig.from_dict(text), **known, extra=extra)

    def layer_specs(self):
        """The drafter's layers: q, attention over the target's K/V, MLP (never double-wide)."""
        tc = self.text_config
        return [replace(spec, kv_source=TARGET, mlp_size=tc.intermediate_size) for spec in tc.layers]


class MaskedEmbedder(nn.Module):
    """The centroid-sparse LM head: logits only for the tokens of the top-k centroids (in
    ``token_ordering``'s grouping), every other token gets the smallest of those minus one."""

    def __init__(self, config: AssistantConfig):
        super().__init__()
        tc = config.text_config
        self.top_k = config.centroid_intermediate_top_k
        self.num_centroids = config.num_centroids
        self.vocab_size = tc.vocab_size
        self.centroids = nn.Linear(tc.hidden_size, config.num_centroids, bias=False)
        self.token_ordering = mx.zeros((tc.vocab_size,), dtype=mx.int32)

    def __call__(self, h: mx.array, embedding: nn.Module) -> mx.array:
        B, L, D = h.shape
        scores = self.centroids(h)
        top = mx.argpartition(-scores, kth=self.top_k - 1, axis=-1)[..., : self.top_k]  # order is irrelevant: scattered
        groups = self.token_ordering.reshape(self.num_centroids, -1)
        tokens = groups[top].reshape(B, L, -1)  # [B, L, top_k * tokens per centroid]
        rows = embedding(tokens)  # the tied LM head's rows (dequantized if quantized)
        picked = (h[..., None, :] @ rows.swapaxes(-1, -2)).squeeze(-2)
        floor = picked.min() - 1.0
        out = mx.full((B, L, self.vocab_size), floor, dtype=picked.dtype)
        return mx.put_along_axis(out, tokens, picked, axis=-1)


class AssistantDecoder(nn.Module):
    """``model.*`` of the checkpoint: the embedding (the tied LM head), the layers, the final norm."""

    def __init__(self, config: AssistantConfig):
        super().__init__()
        tc = config.text_config
        self.embed_tokens = nn.Embedding(tc.vocab_size, tc.hidden_size)
        self.layers = [DecoderLayer(tc, spec) for spec in config.layer_specs()]
        self.norm = nn.RMSNorm(tc.hidden_size, eps=tc.rms_norm_eps)


class Assistant(nn.Module):
    """A Gemma 4 assistant (drafter); see the module docstring."""

    def __init__(self, config: AssistantConfig):
        super().__init__()
        self.config = config
        tc = config.text_config
        self.model = AssistantDecoder(config)
        self.pre_projection = nn.Linear(2 * config.backbone_hidden_size, tc.hidden_size, bias=False)
        self.post_projection = nn.Linear(tc.hidden_size, config.backbone_hidden_size, bias=False)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(tc.hidden_size, tc.vocab_size, bias=False)
        if config.use_ordered_embeddings:
            self.masked_embedding = MaskedEmbedder(config)
        self.tensor_group = None  # split for a tensor-parallel target (gemma4_mlx.distributed.tensor.shard_drafter)

    def materialize(self) -> None:
        """Evaluate every array the drafter holds (see :func:`~gemma4_mlx.models.text.materialize`)."""
        materialize(self)

    @property
    def layers(self):
        return self.model.layers

    @property
    def layer_types(self) -> set[str]:
        return {layer.spec.layer_type for layer in self.model.layers}

    def __call__(self, inputs_embeds: mx.array, target_kv: dict[str, tuple[mx.array, mx.array]], position) -> tuple[mx.array, mx.array]:
        """``(logits, projected hidden)`` for ``inputs_embeds`` [B, L, 2 * backbone] (the target's
        embedding of the last seen token, then its hidden state) at ``position``, attending to
        ``target_kv[layer_type] = (keys, values)`` [B, heads, S, head_dim] without a mask (the
        caller passes exactly the keys to see)."""
        h = self.pre_projection(inputs_embeds)
        for layer in self.model.layers:
            q, _, _ = layer.attention_inputs(h, position)
            keys, values = target_kv[layer.spec.layer_type]
            h = layer.finish(h, ops.attention(q, keys, values, scale=1.0, mask=None))
        h = ops.rms_norm(h, self.model.norm.weight, self.config.text_config.rms_norm_eps)
        if "masked_embedding" in self:
            logits = self.masked_embedding(h, self.model.embed_tokens)
        elif "lm_head" in self:
            logits = self.lm_head(h)
        else:
            logits = self.model.embed_tokens.as_linear(h)
        return logits, self.post_projection(h)

    def check_target(self, target_config: TextConfig, target_name: str = "the target", name: str = "the drafter") -> None:
        """Raise :class:`DrafterMismatchError` unless this drafter fits the target: its width, its
        vocabulary, and for each layer type the head size and K/V heads of the target's K/V."""
        tc = self.config.text_config
        problems = []
        if self.config.backbone_hidden_size != target_config.hidden_size:
            problems.append(f"{name} was made for a hidden size of {self.config.backbone_hidden_size}, {target_name} has {target_config.hidden_size}")
        if tc.vocab_size != target_config.vocab_size:
            problems.append(f"{name} has a vocabulary of {tc.vocab_size} tokens, {target_name} {target_config.vocab_size}")
        own = {s.layer_type: s for s in self.config.layer_specs()}
        for layer_type, spec in own.items():
            source = target_source_spec(target_config, layer_type)
            if source is None:
                problems.append(f"{target_name} has no {layer_type} layer for {name}'s {layer_type} layers")
            elif (source.head_dim, source.num_kv_heads) != (spec.head_dim, spec.num_kv_heads):
                problems.append(
                    f"{name}'s {layer_type} layers expect K/V of {spec.num_kv_heads} heads of {spec.head_dim}, "
                    f"{target_name} has {source.num_kv_heads} of {source.head_dim}"
                )
        if problems:
            raise DrafterMismatchError(f"{name} does not match {target_name}: " + "; ".join(problems))


def target_source_spec(target_config: TextConfig, layer_type: str):
    """The target layer whose K/V a drafter's ``layer_type`` layers read: the last layer of that
    type that computes K/V itself (the layer E2B/E4B's KV-shared layers read, too)."""
    owners = [s for s in target_config.layers if not s.is_kv_shared and s.layer_type == layer_type]
    return owners[-1] if owners else None


__all__ = ["Assistant", "AssistantConfig", "MaskedEmbedder", "target_source_spec", "SLIDING", "FULL"]
