"""Typed configuration for Gemma 4, parsed from a Hugging Face ``config.json``.

Two config forms exist for the text decoder and both are accepted:

* the published form (``global_head_dim``, ``num_global_key_value_heads``), and
* transformers 5.23's ``save_pretrained`` form (``per_layer_config: {"<layer>": {...}}``).

Both are resolved into one list of :class:`LayerSpec`, so the rest of the code never looks at
either form. Unknown keys are kept in ``extra`` rather than rejected: new checkpoints add fields.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError, UnsupportedModelError

SLIDING = "sliding_attention"
FULL = "full_attention"

SUPPORTED_MODEL_TYPES = ("gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text")
# The 12B unified (encoder-free) model: its own multimodal embedders, the same decoder.
UNIFIED_MODEL_TYPES = ("gemma4_unified", "gemma4_unified_text")

# transformers' Gemma4UnifiedTextConfig: no per-layer embeddings or MoE (those fields are deleted
# from it, so its config.json never states them), and other defaults than Gemma4TextConfig's.
UNIFIED_TEXT_DEFAULTS = dict(sliding_window=1024, use_bidirectional_attention="vision", max_position_embeddings=262_144)
UNIFIED_TEXT_ABSENT = dict(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, enable_moe_block=False,
                           num_experts=None, top_k_experts=None, moe_intermediate_size=None)  # fmt: skip


def unified_text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """A ``gemma4_unified_text`` config as a Gemma 4 text config: its defaults, and no PLE or MoE
    (fields a unified config cannot have; a value other than none is refused)."""
    for name, absent in UNIFIED_TEXT_ABSENT.items():
        if raw.get(name) not in (None, absent, 0, False):
            raise ConfigError(f"a Gemma 4 unified text config has no {name} (got {raw[name]!r})")
    return {**UNIFIED_TEXT_DEFAULTS, **raw, **UNIFIED_TEXT_ABSENT}

@dataclass(frozen=True)
class LayerSpec:
    """Everything that differs between decoder layers, resolved once from the config."""

    index: int
    layer_type: str  # SLIDING or FULL
    head_dim: int
    num_kv_heads: int
    k_eq_v: bool  # full layers of 26B/31B: V is the raw k_proj output
    kv_source: int  # layer whose K/V this layer attends over (itself unless KV-shared)
    mlp_size: int  # intermediate size (doubled on KV-shared layers of E2B/E4B)

    @property
    def is_sliding(self) -> bool:
        return self.layer_type == SLIDING

    @property
    def is_kv_shared(self) -> bool:
        return self.kv_source != self.index


def _default_rope_parameters() -> dict[str, dict[str, Any]]:
    return {
        SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
    }


def _has_type(value: Any, hint: Any) -> bool:
    """Whether a JSON value fits a field's annotation (int is not bool; an int fits float)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_has_type(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin is list:
        return isinstance(value, (list, tuple)) and all(_has_type(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(_has_type(k, args[0]) and _has_type(v, args[1]) for k, v in value.items())
    return True


def split_known_keys(cls, raw: dict[str, Any], where: str = "config") -> tuple[dict[str, Any], dict[str, Any]]:
    """Split a config dict into the dataclass's fields and the rest (kept as ``extra``, not fatal).

    The known fields are checked against their annotations, so that a string ``hidden_size`` fails
    here with its name rather than deep inside MLX. ``where`` names the dict in error messages."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a JSON object, not {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
    known = {k: v for k, v in raw.items() if k in names}
    for k, v in known.items():
        if not _has_type(v, hints[k]):
            expected = getattr(hints[k], "__name__", None) or str(hints[k]).replace("typing.", "")
            raise ConfigError(f"{where}.{k} must be {expected}, not {v!r} ({type(v).__name__})")
    extra = {k: v for k, v in raw.items() if k not in names}
    return known, extra


# Sizes that must be positive (a zero or negative one fails obscurely inside MLX).
_POSITIVE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window")  # fmt: skip


@dataclass
class TextConfig:
    """The Gemma 4 text decoder (``text_config`` of ``gemma4``, or a whole ``gemma4_text`` config)."""

    vocab_size: int = 262_144
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 30
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    global_head_dim: int | None = None
    num_global_key_value_heads: int | None = None
    per_layer_config: dict[str, dict[str, Any]] | None = None
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 131_072
    rms_norm_eps: float = 1e-6
    pad_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    bos_token_id: int | None = 2
    tie_word_embeddings: bool = True
    rope_parameters: dict[str, dict[str, Any]] | None = None
    attention_bias: bool = False
    sliding_window: int = 512
    layer_types: list[str] | None = None
    final_logit_softcapping: float | None = None
    use_bidirectional_attention: str | None = None
    vocab_size_per_layer_input: int = 262_144
    hidden_size_per_layer_input: int = 256
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    enable_moe_block: bool = False
    use_double_wide_mlp: bool = False
    num_experts: int | None = None
    top_k_experts: int | None = None
    moe_intermediate_size: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if self.layer_types is None:
            # transformers' default pattern: five sliding layers, then one full layer.
            self.layer_types = [FULL if (i + 1) % 6 == 0 else SLIDING for i in range(self.num_hidden_layers)]
        self.layer_types = list(self.layer_types)
        if len(self.layer_types) != self.num_hidden_layers:
            raise UnsupportedModelError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}"
            )
        unknown = set(self.layer_types) - {SLIDING, FULL}
        if unknown:
            raise UnsupportedModelError(f"unknown layer types {sorted(unknown)}")
        # transformers forces the last layer to full attention; so do we.
        self.layer_types[-1] = FULL
        if self.rope_parameters is None:
            self.rope_parameters = _default_rope_parameters()
        if self.use_bidirectional_attention == "all":
            raise UnsupportedModelError(
                "use_bidirectional_attention='all' (an encoder-style Gemma 4) is not a generative chat model"
            )
        if self.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise UnsupportedModelError(f"unsupported hidden_activation {self.hidden_activation!r}")
        if self.enable_moe_block and not (self.num_experts and self.top_k_experts and self.moe_intermediate_size):
            raise UnsupportedModelError("enable_moe_block needs num_experts, top_k_experts and moe_intermediate_size")
        self.layers = self._resolve_layers()

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "text_config") -> "TextConfig":
        known, extra = split_known_keys(cls, raw, where)
        for name in _POSITIVE_FIELDS:
            if name in known and known[name] <= 0:
                raise ConfigError(f"{where}.{name} must be positive, not {known[name]}")
        return cls(**known, extra=extra)

    def _resolve_layers(self) -> list[LayerSpec]:
        n = self.num_hidden_layers
        overrides: dict[int, dict[str, Any]] = {}
        if self.per_layer_config is not None:
            # transformers 5.23 form: explicit per-layer overrides, keyed by layer index.
            overrides = {int(k): dict(v) for k, v in self.per_layer_config.items()}
        else:
            # Published form: full layers get global_head_dim (512 unless stated), and with
            # attention_k_eq_v also num_global_key_value_heads.
            full = {"head_dim": self.global_head_dim or 512}
            if self.attention_k_eq_v and self.num_global_key_value_heads is not None:
                full["num_key_value_heads"] = self.num_global_key_value_heads
            overrides = {i: full for i, t in enumerate(self.layer_types) if t == FULL}

        first_shared = n - self.num_kv_shared_layers
        # KV-shared layers read the K/V of the last non-shared layer of the same type.
        last_of_type = {t: i for i, t in enumerate(self.layer_types[:first_shared])}
        specs = []
        for i, layer_type in enumerate(self.layer_types):
            o = overrides.get(i, {})
            shared = i >= first_shared
            if shared and layer_type not in last_of_type:
                raise UnsupportedModelError(f"KV-shared layer {i} ({layer_type}) has no earlier layer to share K/V with")
            specs.append(
                LayerSpec(
                    index=i,
                    layer_type=layer_type,
                    head_dim=int(o.get("head_dim", self.head_dim)),
                    num_kv_heads=int(o.get("num_key_value_heads", self.num_key_value_heads)),
                    k_eq_v=self.attention_k_eq_v and layer_type == FULL,
                    kv_source=last_of_type[layer_type] if shared else i,
                    mlp_size=self.intermediate_size * (2 if self.use_double_wide_mlp and shared else 1),
                )
            )
        return specs

    def rope_for(self, layer_type: str) -> dict[str, Any]:
        return dict(self.rope_parameters.get(layer_type) or _default_rope_parameters()[layer_type])

    @property
    def has_per_layer_inputs(self) -> bool:
        return bool(self.hidden_size_per_layer_input)


@dataclass
class ModelConfig:
    """A whole Gemma 4 checkpoint: the text decoder, optional towers, and the special token ids."""

    model_type: str
    text_config: TextConfig
    vision_config: dict[str, Any] | None = None
    audio_config: dict[str, Any] | None = None
    image_token_id: int | None = 258_880
    audio_token_id: int | None = 258_881
    video_token_id: int | None = 258_884
    boi_token_id: int | None = 255_999
    eoi_token_id: int | None = 258_882
    boa_token_id: int | None = 256_000
    eoa_token_id: int | None = 258_883
    quantization: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        if not isinstance(raw, dict):
            raise ConfigError(f"a config must be a JSON object, not {type(raw).__name__}")
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = raw.get("architectures") or []
            raise UnsupportedModelError(
                f"not a Gemma 4 checkpoint: model_type is {model_type!r}"
                + (f" (architectures {archs})" if archs else "")
                + f"; expected one of {SUPPORTED_MODEL_TYPES}"
            )
        raw = dict(raw)
        quantization = raw.pop("quantization", None) or raw.pop("quantization_config", None)
        if quantization is not None and not isinstance(quantization, dict):
            raise ConfigError(f"quantization must be a JSON object, not {type(quantization).__name__}")
        unified = model_type in UNIFIED_MODEL_TYPES
        if model_type in ("gemma4_text", "gemma4_unified_text"):
            text_raw = {k: v for k, v in raw.items() if k != "model_type"}
            text = TextConfig.from_dict(unified_text_config(text_raw) if unified else text_raw, where="config")
            return cls(model_type=model_type, text_config=text, quantization=quantization)

        text_raw = raw.get("text_config") or {}
        if not isinstance(text_raw, dict):
            raise ConfigError(f"text_config must be a JSON object, not {type(text_raw).__name__}")
        for tower in ("vision_config", "audio_config"):
            if raw.get(tower) is not None and not isinstance(raw[tower], dict):
                raise ConfigError(f"{tower} must be a JSON object or null, not {type(raw[tower]).__name__}")
        text_raw = dict(text_raw)
        # Published configs may carry vocab_size only at the top level, or only in text_config.
        if "vocab_size" not in text_raw and "vocab_size" in raw:
            text_raw["vocab_size"] = raw["vocab_size"]
        text_raw.pop("model_type", None)
        ids = {}
        for name in ("image_token_id", "audio_token_id", "video_token_id", "boi_token_id", "eoi_token_id", "boa_token_id"):
            if name in raw:
                ids[name] = raw[name]
        # transformers names the end-of-audio id `eoa_token_index`; some configs say `eoa_token_id`.
        if "eoa_token_index" in raw or "eoa_token_id" in raw:
            ids["eoa_token_id"] = raw.get("eoa_token_id", raw.get("eoa_token_index"))
        for name, value in ids.items():
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ConfigError(f"{name} must be a non-negative integer, not {value!r}")
        consumed = {"model_type", "text_config", "vision_config", "audio_config", "eoa_token_index", *ids}
        return cls(
            model_type=model_type,
            text_config=TextConfig.from_dict(unified_text_config(text_raw) if unified else text_raw),
            vision_config=raw.get("vision_config"),
            audio_config=raw.get("audio_config"),
            quantization=quantization,
            extra={k: v for k, v in raw.items() if k not in consumed},
            **ids,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        """Parse a ``config.json``; every problem with the file is an error that names it."""
        path = Path(path)
        raw = read_json(path, what="a model config", missing=f"no config.json in {path.parent}: is this a model folder?")
        try:
            return cls.from_dict(raw)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    @property
    def is_unified(self) -> bool:
        """The 12B unified model (patches and waveforms embedded straight into the decoder)."""
        return self.model_type in UNIFIED_MODEL_TYPES

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.text_config.eos_token_id
        if eos is None:
            eos = self.extra.get("eos_token_id")
        if eos is None:
            return []
        return [eos] if isinstance(eos, int) else list(eos)


def read_json_object(path: Path, what: str) -> dict[str, Any]:
    """A JSON file that must hold an object (a processor or generation config, a weight index)."""
    raw = read_json(path, what)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a JSON object ({what}), not {type(raw).__name__}")
    return raw


def read_json(path: Path, what: str = "JSON", missing: str | None = None) -> Any:
    """A JSON file's value; a missing file raises ``FileNotFoundError`` (``missing`` as its message),
    anything unreadable a :class:`ConfigError` naming the file."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(missing or f"{path} not found") from None
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text (byte {e.start}): not {what}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
