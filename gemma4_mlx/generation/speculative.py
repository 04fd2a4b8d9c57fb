"""Speculative decoding with a Gemma 4 assistant (multi-token prediction).

Each round, the drafter proposes ``K`` tokens from the target's last hidden state and K/V (read in
place from the target's caches), the target checks them all in one forward pass of ``K + 1`` tokens,
the longest acceptable prefix is kept plus one token of the target's own, and every cache is cut
back to what was accepted. The round loop mirrors transformers' ``SinglePositionMultiTokenCandidate
Generator``: the drafter's input is the target's embedding of the last seen token beside the target's
hidden state that predicted it, its position is that token's, constant while it drafts.

Acceptance keeps the target's output distribution exactly: greedy, a drafted token is kept when it
is the target's argmax; sampling, the standard rule (Leviathan et al., 2023) keeps token ``d`` with
probability ``min(1, p(d) / q(d))`` and on a rejection draws from ``max(p - q, 0)``, renormalised,
where ``p`` and ``q`` are the target's and the drafter's distributions after the same logits
processors, filters (top-p, min-p, top-k) and temperature. One host sync per round: the decision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generator

import mlx.core as mx
import numpy as np

from ..errors import OptionError
from ..models.assistant import Assistant, target_source_spec
from ..models.cache import PassedLayerCache, in_temporal_order, last_tokens, trim_after_chunk
from .decode import GENERATION_STREAM, prefill, processed_logprobs

DEFAULT_DRAFT_TOKENS = 4


@dataclass
class SpeculativeStats:
    """What the drafter achieved in one reply."""

    target_steps: int = 0  # forward passes of the target after the prompt (verify steps)
    drafted: int = 0  # tokens the drafter proposed
    accepted: int = 0  # of those, kept

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens generated per target forward pass (1.0 without a drafter)."""
        return (self.accepted + self.target_steps) / self.target_steps if self.target_steps else 1.0


def _source_layers(model, layer_types) -> dict[str, int]:
    """For each drafter layer type, the target layer it reads (the last layer of that type owning K/V)."""
    return {t: target_source_spec(model.text_config, t).index for t in layer_types}


def _source_caches(model, cache: list, layer_types) -> dict[str, Any]:
    """For each drafter layer type, the target cache it reads (KV-owning layers come first: index = layer)."""
    layers = _source_layers(model, layer_types)
    sources = {t: cache[i] for t, i in layers.items()}
    missing = sorted(i for t, i in layers.items() if isinstance(sources[t], PassedLayerCache))
    if missing:
        raise OptionError(
            f"this cache was made before the draft model was attached: this process of the pipeline keeps no copy "
            f"of layer {', '.join(map(str, missing))}, which the drafter reads; make the cache after loading the drafter"
        )
    return sources


def _drafter_kv(sources: dict[str, Any], window: int, keys_from_values: dict[str, Any] | None = None) -> dict[str, tuple[mx.array, mx.array]]:
    """The target's K/V as the drafter reads them: every past token for full layers, the last
    ``window + 1`` for sliding ones (transformers' bidirectional window, distance <= window).
    ``keys_from_values[layer_type]`` makes a K=V source's keys from its values instead (pipeline)."""
    kv = {}
    for layer_type, c in sources.items():
        keys, values = in_temporal_order(c)
        if (keys_from_values or {}).get(layer_type) is not None:
            keys = keys_from_values[layer_type](values)
        if layer_type == "sliding_attention":
            keys, values = last_tokens(keys, window + 1), last_tokens(values, window + 1)
        kv[layer_type] = (keys, values)
    return kv


def speculative_tokens(
    model,
    drafter,
    prompt: mx.array,
    cache: list,
    max_tokens: int,
    sampler: Callable[[mx.array], mx.array],
    logits_processors: list[Callable] | None = None,
    distribution: Callable[[mx.array], mx.array] | None = None,
    num_draft_tokens: int = DEFAULT_DRAFT_TOKENS,
    prefill_step_size: int = 2048,
    prompt_progress: Callable[[int, int], Any] | None = None,
    inputs_embeds: mx.array | None = None,
    history: mx.array | None = None,
    vision_blocks: np.ndarray | None = None,
    stats: SpeculativeStats | None = None,
) -> Generator[tuple[int, mx.array], None, None]:
    """Yield ``(token, logprobs)`` like :func:`~gemma4_mlx.generation.decode.generate_tokens`, with
    ``drafter`` proposing ``num_draft_tokens`` tokens per target step (see the module docstring).

    ``distribution`` (``GenerationOptions.make_distribution()``) is the sampler's distribution as
    log-probabilities; None means greedy (``sampler`` is then only used for the first token)."""
    if max_tokens <= 0:
        return
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be at least 1, not {num_draft_tokens}")
    stats = stats if stats is not None else SpeculativeStats()
    processors = logits_processors or []
    history = mx.array(prompt if history is None else history)
    window = model.text_config.sliding_window
    sources = _source_caches(model, cache, drafter.layer_types)
    embed = model.language_model.embed
    stage = model.language_model.stage
    # Pipeline: a K=V source's copy on another process holds its values; all processes make its keys
    # from them alike (made when read: after the forward passes that gather its k_norm weight).
    derive = (lambda: {t: stage.drafter_keys(i) for t, i in _source_layers(model, drafter.layer_types).items()}) if stage else dict

    def processed(logits: mx.array, context: mx.array) -> mx.array:
        return processed_logprobs(logits, processors, context)

    prompt = mx.array(prompt)
    with mx.stream(GENERATION_STREAM):
        # All but the last two prompt tokens fill the cache; the last two (a multi-token update keeps
        # the sliding buffers in temporal order) give the hidden state the drafter starts from.
        tail = min(2, prompt.size)
        blocks = None if vision_blocks is None else vision_blocks[:-tail]
        prefill(model, prompt[:-tail], cache, prefill_step_size, prompt_progress, inputs_embeds, blocks)
        hidden, logits = model.forward(
            prompt[None, -tail:], cache, inputs_embeds=None if inputs_embeds is None else inputs_embeds[None, -tail:],
            vision_blocks=None if vision_blocks is None else vision_blocks[None, -tail:], return_hidden=True,
        )  # fmt: skip
        logprobs = processed(logits[:, -1], history)
        token = sampler(logprobs)
        hidden = hidden[:, -1:]
        mx.eval(token, hidden, logprobs)
        history = mx.concatenate([history, token]) if processors else history
    produced = 1
    yield token.item(), logprobs.squeeze(0)

    while produced < max_tokens:
        k = min(num_draft_tokens, max_tokens - produced - 1)
        with mx.stream(GENERATION_STREAM):
            position = mx.array(cache[0].offset, dtype=mx.int32)
            kv = _drafter_kv(sources, window, derive())
            drafts, draft_logprobs = [], []
            last, state, context = token, hidden, history
            for _ in range(k):
                draft_logits, state = drafter(mx.concatenate([embed(last[None]), state], axis=-1), kv, position)
                q = processed(draft_logits[:, -1], context)
                if distribution is None:
                    last = mx.argmax(q, axis=-1)
                else:
                    q = distribution(q)
                    last = mx.random.categorical(q)
                drafts.append(last)
                draft_logprobs.append(q)
                if processors:
                    context = mx.concatenate([context, last])
            candidates = mx.concatenate([token, *drafts])
            hidden_all, logits = model.forward(candidates[None], cache, return_hidden=True)
            target_logprobs, context = [], history
            for i in range(k + 1):
                target_logprobs.append(processed(logits[:, i], context))
                if processors and i < k:
                    context = mx.concatenate([context, drafts[i]])
            accepted, fallback = _accept(drafts, draft_logprobs, target_logprobs, distribution)
            mx.eval(accepted, fallback, candidates, target_logprobs)
            n = int(accepted.item())
            new_tokens = candidates[1 : n + 1].tolist() + [int(fallback[n].item())]
            trim_after_chunk(cache, k - n)
            hidden = hidden_all[:, n : n + 1]
            token = mx.array(new_tokens[-1:], dtype=candidates.dtype)
            if processors:
                history = mx.concatenate([history, mx.array(new_tokens, dtype=history.dtype)])
        stats.target_steps += 1
        stats.drafted += k
        stats.accepted += n
        for i, t in enumerate(new_tokens):
            produced += 1
            # The cache holds this round's kept drafts; stopping before the last of them were emitted
            # cuts it back, so that it holds no token the caller never saw (what a chat reuses).
            unseen = max(0, n - 1 - i)
            try:
                yield t, target_logprobs[i].squeeze(0)
            except GeneratorExit:
                with mx.stream(GENERATION_STREAM):
                    trim_after_chunk(cache, unseen)
                raise
            if produced >= max_tokens:  # k left room for all of them: nothing unseen in the cache
                return
        if stats.target_steps % 64 == 0:
            mx.clear_cache()


def load_checked_drafter(draft_model, model, num_draft_tokens: int, fit: bool = True):
    """The loaded drafter for ``draft_model`` (None: no speculative decoding), checked against the
    target and (``fit``) fitted to a target shared by processes (:func:`fit_to_processes`)."""
    if draft_model is None:
        return None
    if not (isinstance(num_draft_tokens, int) and not isinstance(num_draft_tokens, bool) and 1 <= num_draft_tokens <= 64):
        raise OptionError(f"num_draft_tokens must be an integer from 1 to 64, not {num_draft_tokens!r}")
    from ..loading.assistant import load_drafter

    if isinstance(draft_model, Assistant):
        drafter, name = draft_model, "the draft model"
    else:
        drafter, name = load_drafter(draft_model), f"the draft model {draft_model}"
    drafter.check_target(model.text_config, name=name)
    if fit:
        fit_to_processes(drafter, model)
    return drafter


def fit_to_processes(drafter, model) -> None:
    """Fit ``drafter`` to a target shared by processes (``load_sharded``), where every process drafts
    the same tokens by itself: under pipeline parallelism each keeps copies of the target layers the
    drafter reads (every process must attach the same drafter, before making its caches); under
    tensor parallelism the drafter's layers are split as the target's (in place)."""
    text = model.language_model
    group = text.tensor_group
    if drafter.tensor_group is not None and drafter.tensor_group is not group:
        raise OptionError("this draft model was split for another tensor-parallel model: load it again for this one")
    if group is not None and drafter.tensor_group is None:
        from ..distributed.tensor import shard_drafter

        shard_drafter(drafter, group, model.text_config.num_attention_heads)
    if text.stage is not None:
        text.stage.use_drafter_sources(_source_layers(model, drafter.layer_types).values())


def _accept(drafts, draft_logprobs, target_logprobs, distribution):
    """``(accepted, fallback)``: how many drafted tokens to keep (a scalar), and for every position
    i the token to emit if the round stops there (the target's choice after the i kept drafts)."""
    k = len(drafts)
    p = mx.concatenate(target_logprobs)  # [k + 1, V]
    if distribution is None:
        choice = mx.argmax(p, axis=-1)
        if k == 0:
            return mx.array(0), choice
        keep = mx.concatenate(drafts) == choice[:k]
    else:
        p = distribution(p)
        if k == 0:
            return mx.array(0), mx.random.categorical(p)
        d = mx.concatenate(drafts)
        q = mx.concatenate(draft_logprobs)  # [k, V], already the drafter's sampling distribution
        p_d = mx.take_along_axis(p[:k], d[:, None], axis=-1)[:, 0]
        q_d = mx.take_along_axis(q, d[:, None], axis=-1)[:, 0]
        keep = mx.random.uniform(shape=(k,)) < mx.exp(mx.minimum(p_d - q_d, 0.0))
        # On a rejection at i: a draw from max(p_i - q_i, 0); after all k kept: a draw from p_k.
        residual = mx.maximum(mx.exp(p[:k]) - mx.exp(q), 0.0)
        residual = mx.log(residual / mx.maximum(residual.sum(axis=-1, keepdims=True), 1e-30))
        choice = mx.concatenate([mx.random.categorical(residual), mx.random.categorical(p[k:])])
    accepted = mx.cumprod(keep.astype(mx.int32)).sum()
    return accepted, choice


__all__ = ["speculative_tokens", "load_checked_drafter", "fit_to_processes", "SpeculativeStats", "DEFAULT_DRAFT_TOKENS"]
