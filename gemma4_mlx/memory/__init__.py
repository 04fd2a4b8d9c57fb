"""How much memory a model needs at a given context, before running it.

``estimate(path_or_config, context)`` adds up what generation holds:

* **weights**: the tensors loaded from the checkpoint (from the safetensors headers, no data read),
  or, with only a ``config.json``, the parameters of the model it describes (quantized as its
  ``quantization`` section says); the E2B/E4B per-layer table stays on disk, memory-mapped, by default;
* **KV cache**: per layer that owns K/V, keys and values of every token for full-attention layers
  (grown as mlx-lm's cache grows them, in steps of 256) and of the window for sliding layers
  (KV-shared layers hold none; the K=V full layers of the 26B/31B hold their values alone, their keys
  made from them when read); in the model's dtype, or quantized (``kv_bits``: packed values plus
  a scale and a bias per ``kv_group_size`` values);
* **workspace**: what one prefill chunk needs on top: its attention scores (bounded by the
  blockwise-attention budget), the keys a K=V layer makes from its values (bounded by the same
  budget), the sliding buffers' transient chunk, and the chunk's activations.

The KV figure is exact for this project's caches once the context passes the sliding window
(tested; below it a sliding buffer may hold up to a window it does not use yet); the workspace is
an estimate.
``python -m gemma4_mlx.memory --model ... --context N`` prints it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..config import ModelConfig, TextConfig

GB = 1e9


@dataclass
class MemoryEstimate:
    """Bytes a generation at ``context`` tokens needs, by part."""

    context: int
    weights: int
    kv_cache: int
    workspace: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.workspace

    def summary(self) -> str:
        return (
            f"{self.context} tokens: weights {self.weights / GB:.2f} GB + KV cache {self.kv_cache / GB:.2f} GB "
            f"+ workspace {self.workspace / GB:.2f} GB = {self.total / GB:.2f} GB"
        )


def full_cache_tokens(context: int, prefill_step_size: int = 2048, step: int = 256) -> int:
    """Tokens a full-attention layer's buffer holds after a prompt prefilled in chunks, then decoded
    one token at a time, up to ``context`` tokens: mlx-lm's ``KVCache`` growth rule, replayed."""
    size = offset = 0

    def add(n: int) -> None:
        nonlocal size, offset
        if offset + n > size:
            if offset % step:
                size = offset
            size += -(-n // step) * step
        offset += n

    for start in range(0, max(0, context - 1), prefill_step_size):
        add(min(prefill_step_size, context - 1 - start))
    if context:
        add(1)
    return size


def kv_value_bytes(bytes_per_value: int = 2, kv_bits: int | None = None, kv_group_size: int = 64) -> float:
    """Bytes the cache holds per key or value element: the model dtype's, or, quantized, the packed
    bits plus a scale and a bias (in the model dtype) per group."""
    return bytes_per_value if kv_bits is None else kv_bits / 8 + 2 * bytes_per_value / kv_group_size


def kv_cache_bytes(
    text: TextConfig, context: int, bytes_per_value: int = 2, sliding_slack: int = 0, prefill_step_size: int = 2048,
    kv_bits: int | None = None, kv_group_size: int = 64, single_kv_storage: bool = True, layers=None, tensor_parallel: int = 1,
) -> int:  # fmt: skip
    """Bytes of the KV cache after ``context`` tokens (see the module docstring; ``single_kv_storage``
    as ``Gemma4Model.make_cache`` takes it); ``layers``: only the caches of these layer indices;
    ``tensor_parallel``: one process's share when that many split the K/V heads (where they divide)."""
    total = 0
    full_tokens = full_cache_tokens(context, prefill_step_size)
    element = kv_value_bytes(bytes_per_value, kv_bits, kv_group_size)
    for spec in text.layers:
        if spec.is_kv_shared or (layers is not None and spec.index not in layers):
            continue
        tensors = 1 if spec.k_eq_v and single_kv_storage else 2
        heads = spec.num_kv_heads
        if tensor_parallel > 1:  # what each process keeps (see gemma4_mlx.distributed.tensor)
            from ..distributed.tensor import kv_heads_held

            heads = kv_heads_held(text.num_attention_heads, heads, tensor_parallel)
        per_token = round(tensors * heads * spec.head_dim * element)
        tokens = min(context, text.sliding_window + sliding_slack) if spec.is_sliding else full_tokens
        total += per_token * tokens
    return total


def workspace_bytes(
    text: TextConfig, context: int, prefill_step_size: int = 2048, bytes_per_value: int = 2, kv_bits: int | None = None,
    single_kv_storage: bool = True,
) -> int:  # fmt: skip
    """An estimate of one prefill chunk's working memory at ``context`` tokens."""
    from ..ops import blockwise

    chunk = min(prefill_step_size, max(1, context))
    heads = text.num_attention_heads
    scores = min(heads * chunk * context * 4, max(blockwise.SCORES_BUDGET, heads * context * 4))
    sliding = sum(2 * s.num_kv_heads * s.head_dim * bytes_per_value for s in text.layers if s.is_sliding and not s.is_kv_shared)
    widest_mlp = max(s.mlp_size for s in text.layers)
    activations = chunk * (3 * widest_mlp + 8 * text.hidden_size) * bytes_per_value  # gate, up, their product; residuals
    logits = text.vocab_size * 4 * 2
    # A K=V layer's keys made from its values (and the values dequantized, when quantized): at most
    # the scores budget at once; past it a key block at a time (ops/blockwise.py), counted as the
    # budget all the same, so that the estimate never shrinks as the context grows.
    derived = 0
    if single_kv_storage and any(s.k_eq_v for s in text.layers):
        widest = max(s.num_kv_heads * s.head_dim for s in text.layers if s.k_eq_v)
        derived = min(widest * context * bytes_per_value * (2 if kv_bits is not None else 1), blockwise.SCORES_BUDGET)
    return scores + derived + sliding * chunk + activations + logits


def context_bytes(
    text: TextConfig, context: int, prefill_step_size: int = 2048, bytes_per_value: int = 2, kv_bits: int | None = None,
    kv_group_size: int = 64, single_kv_storage: bool = True,
) -> int:  # fmt: skip
    """KV cache and workspace at ``context`` tokens: what a context adds to the weights."""
    kv = kv_cache_bytes(text, context, bytes_per_value, 0, prefill_step_size, kv_bits, kv_group_size, single_kv_storage)
    return kv + workspace_bytes(text, context, prefill_step_size, bytes_per_value, kv_bits, single_kv_storage)


def _longest_within(
    text: TextConfig, budget: float, limit: int, prefill_step_size: int, bytes_per_value: int = 2, kv_bits=None,
    kv_group_size: int = 64, single_kv_storage: bool = True,
) -> int:  # fmt: skip
    """The longest context up to ``limit`` whose :func:`context_bytes` fit ``budget`` (0 if none)."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        fits = context_bytes(text, mid, prefill_step_size, bytes_per_value, kv_bits, kv_group_size, single_kv_storage) <= budget
        lo, hi = (mid, hi) if fits else (lo, mid - 1)
    return lo


def weights_bytes(path: Path, config: ModelConfig, mapped_ple: bool = True) -> int:
    """Bytes of the tensors in ``path``'s safetensors files (``mx.load`` is lazy: only their headers
    are read), without the per-layer table when it stays memory-mapped; a folder with only
    ``config.json``: the bytes of the parameters of the model it describes."""
    return sum(_tensor_bytes(path, config, mapped_ple).values())


def _tensor_bytes(path: Path | None, config: ModelConfig, mapped_ple: bool = True) -> dict[str, int]:
    """Bytes per tensor, by our module tree's names: of a folder's safetensors files (headers only),
    or of the model a bare config describes; the memory-mapped per-layer table left out."""
    from ..loading.checkpoint import read_weights, sanitize

    files = sorted(path.glob("*.safetensors")) if path is not None else []
    if not files:
        return _described_tensor_bytes(config)
    return {k: v.nbytes for k, v in sanitize(read_weights(files), config).items() if not (mapped_ple and "embed_tokens_per_layer" in k)}


def _described_weights_bytes(config: ModelConfig) -> int:
    return sum(_described_tensor_bytes(config).values())


def _described_tensor_bytes(config: ModelConfig) -> dict[str, int]:
    """Parameter bytes of the (lazy, never evaluated) model ``config`` describes, bf16 or quantized."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    import mlx.core as mx

    from ..loading.quantization import TOWERS
    from ..models import build_model

    model = build_model(config)
    model.set_dtype(mx.bfloat16)  # before quantizing, as the converter does: bf16 scales and biases too
    q = config.quantization
    if q:
        overrides = {k: v for k, v in q.items() if isinstance(v, dict)}  # per-module bits, as the file says
        nn.quantize(model, group_size=q.get("group_size", 64), bits=q.get("bits", 4), mode=q.get("mode", "affine"),
                    class_predicate=lambda p, m: hasattr(m, "to_quantized") and not p.startswith(TOWERS) and overrides.get(p, True))  # fmt: skip
    return {k: v.nbytes for k, v in tree_flatten(model.parameters()) if "embed_tokens_per_layer" not in k}


def _resolve(path_or_config: str | Path) -> tuple[Path | None, ModelConfig]:
    """``(model folder or None for a bare config.json, its config)``."""
    from ..loading import resolve_model_path

    path = Path(path_or_config).expanduser()
    if path.is_file():
        return None, ModelConfig.from_file(path)
    folder = resolve_model_path(str(path_or_config))
    return folder, ModelConfig.from_file(folder / "config.json")


def estimate(
    path_or_config: str | Path, context: int, prefill_step_size: int = 2048, mapped_ple: bool = True,
    kv_bits: int | None = None, kv_group_size: int = 64,
) -> MemoryEstimate:  # fmt: skip
    """The memory a generation at ``context`` tokens needs (a model folder, a Hub id, or a
    ``config.json``), with a KV cache quantized to ``kv_bits`` if given; see the module docstring."""
    folder, config = _resolve(path_or_config)
    text = config.text_config
    weights = weights_bytes(folder, config, mapped_ple) if folder is not None else _described_weights_bytes(config)
    kv = kv_cache_bytes(text, context, 2, 0, prefill_step_size, kv_bits, kv_group_size)
    return MemoryEstimate(context, weights, kv, workspace_bytes(text, context, prefill_step_size, 2, kv_bits))


_SPLIT_BY_TENSOR_PARALLELISM = re.compile(r"\.(self_attn\.(q|o)_proj|mlp\.(gate|up|down)_proj|experts\.switch_glu\.(gate|up|down)_proj)\.")
_KV_PROJECTION = re.compile(r"language_model\.layers\.(\d+)\.self_attn\.(k|v)_proj\.")


def process_estimates(
    path_or_config: str | Path, context: int, processes: int, split: str | None = None, prefill_step_size: int = 2048,
    mapped_ple: bool = True, kv_bits: int | None = None, kv_group_size: int = 64, parallel: str = "pipeline",
) -> list[tuple[str, MemoryEstimate]]:  # fmt: skip
    """Per process of a pipeline (see :mod:`gemma4_mlx.distributed.pipeline`): its layers and the
    memory it needs at ``context`` tokens: its weights (its layers', the embeddings every process
    holds, and on the first the media encoders), the caches of its layers (and of the layers whose
    K/V its KV-shared layers read), and the workspace (every process applies the LM head).
    ``parallel="tensor"`` (:mod:`gemma4_mlx.distributed.tensor`): every process the same share of
    every layer's projections and K/V heads (where they divide), and the rest whole."""
    from ..distributed.pipeline import PipelineStage, parse_split, split_layers

    folder, config = _resolve(path_or_config)
    text = config.text_config
    if parallel == "tensor":
        from ..distributed.tensor import check_divisible, kv_heads_held

        check_divisible(text, processes)

        def share(name: str, n: int) -> int:
            if (kv := _KV_PROJECTION.match(name)) is not None:
                spec = text.layers[int(kv.group(1))]
                return n * kv_heads_held(text.num_attention_heads, spec.num_kv_heads, processes) // spec.num_kv_heads
            return -(-n // processes) if _SPLIT_BY_TENSOR_PARALLELISM.search(name) else n

        weights = sum(share(k, n) for k, n in _tensor_bytes(folder, config, mapped_ple).items())
        kv = kv_cache_bytes(text, context, 2, 0, prefill_step_size, kv_bits, kv_group_size, tensor_parallel=processes)
        estimate = MemoryEstimate(context, weights, kv, workspace_bytes(text, context, prefill_step_size, 2, kv_bits))
        return [(f"1/{processes} of every layer", estimate)] * processes
    counts = parse_split(split, processes, text.num_hidden_layers) if split else split_layers(text.num_hidden_layers, processes)
    tensors = _tensor_bytes(folder, config, mapped_ple)
    workspace = workspace_bytes(text, context, prefill_step_size, 2, kv_bits)
    out = []
    for rank in range(processes):
        stage = PipelineStage.planned(text, counts, rank)
        weights = sum(n for k, n in tensors.items() if stage.keeps(k))
        layers = {i for i in range(text.num_hidden_layers) if stage.cached_here(i)}
        kv = kv_cache_bytes(text, context, 2, 0, prefill_step_size, kv_bits, kv_group_size, layers=layers)
        out.append((f"layers {stage.start}-{stage.end - 1}", MemoryEstimate(context, weights, kv, workspace)))
    return out


def longest_context(path_or_config: str | Path, memory: float, prefill_step_size: int = 2048, kv_bits: int | None = None, kv_group_size: int = 64) -> int:
    """The longest context (tokens, up to the model's maximum) whose estimate fits ``memory`` bytes
    (0 when not even the weights fit)."""
    folder, config = _resolve(path_or_config)
    text = config.text_config
    weights = weights_bytes(folder, config) if folder is not None else _described_weights_bytes(config)
    return _longest_within(text, memory - weights, text.max_position_embeddings, prefill_step_size, 2, kv_bits, kv_group_size)


def check_fits(
    model, context: int, cache: list | None = None, prefill_step_size: int = 2048, kv_bits: int | None = None,
    kv_group_size: int = 64,
) -> None:  # fmt: skip
    """Raise :class:`~gemma4_mlx.errors.ContextLengthError` when a generation reaching ``context``
    tokens would need more memory for its KV cache (quantized to ``kv_bits`` if given) and workspace
    than the device has free (the loaded weights and ``cache``, the cache it continues or replaces,
    count as used), saying what would fit: better than being killed by the operating system halfway
    through a prefill."""
    import mlx.core as mx

    from ..errors import ContextLengthError

    from ..models.cache import ValueOnlyKVCache

    text = model.text_config
    value_bytes = 4 if model.language_model.embed_tokens.weight.dtype == mx.float32 else 2
    # The storage of the cache continued (or, for a new one, what make_cache gives by default).
    single = cache is None or any(isinstance(c, ValueOnlyKVCache) for c in cache) or not any(s.k_eq_v for s in text.layers)
    quantization = (kv_bits, kv_group_size, single)
    needed = context_bytes(text, context, prefill_step_size, value_bytes, *quantization)
    held = sum(c.nbytes for c in cache or () if not c.empty())
    # Against all of the machine's memory, not Metal's recommended working set: past the first MLX
    # still runs (slower), past the second nothing does. No refusal on a guess that might be wrong.
    free = device_memory(hard=True) - mx.get_active_memory() + held
    if needed <= free:
        return
    fits = _longest_within(text, free, context, prefill_step_size, value_bytes, *quantization)
    smaller_cache = "" if kv_bits is not None and kv_bits <= 4 else ", a quantized KV cache (kv_bits=8 or 4; --kv-bits)"
    raise ContextLengthError(
        f"a context of {context} tokens (prompt and max_tokens) needs about {needed / GB:.1f} GB for its KV cache and "
        f"working memory, and {max(free, 0) / GB:.1f} GB is free on this device: about {fits} tokens would fit. "
        f"Use a shorter prompt or fewer max_tokens{smaller_cache}, a smaller model, or quantized weights (python -m convert -q)"
    )


def device_memory(hard: bool = False) -> int:
    """Memory the default device can use: on Apple silicon Metal's recommended working set (with
    ``hard``, all of the machine's memory, the limit past which nothing can run), else the physical
    memory."""
    import os

    import mlx.core as mx

    try:
        info = mx.device_info()
        key = "memory_size" if hard else "max_recommended_working_set_size"
        if key in info:
            return int(info[key])
    except Exception:  # an MLX without device_info
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


__all__ = ["MemoryEstimate", "estimate", "longest_context", "check_fits", "context_bytes", "kv_cache_bytes", "kv_value_bytes", "workspace_bytes", "weights_bytes", "device_memory"]
