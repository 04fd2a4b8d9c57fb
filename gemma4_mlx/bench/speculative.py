"""Benchmark: speculative decoding with an assistant drafter, side by side with plain decoding and
mlx-lm (which has no drafter support) in one run.

    python -m gemma4_mlx.bench --speculative                        # E2B and 31B shapes
    python -m gemma4_mlx.bench --speculative --variants e2b --draft-tokens 2 4 8

Per variant and number of drafted tokens K it reports:

* **verify / decode cost**: the time of one target forward pass over K + 1 tokens relative to one
  decode step (what a round costs the target; speculative decoding wins when rounds keep more than
  that many tokens);
* **target steps per token** and **decode tokens/s** with two drafters, both of the drafter's real
  shape (4 layers, width 256; the published drafters' widths are not known here):
  a *random* drafter (random weights: it proposes garbage, almost nothing is accepted; the cost
  floor), and an *agreeing* drafter, which runs that same network (its cost is paid) but proposes
  the target's own greedy continuation (everything is accepted; the upper bound). Real drafters land
  between the two; the published ones are reported to keep most drafts on chat text.

Random weights cannot say how often a real drafter is right: read the two rows as bounds.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import make_sampler

from ..config import FULL, SLIDING, TextConfig
from ..generation.decode import generate_tokens
from ..generation.speculative import SpeculativeStats, speculative_tokens
from ..loading.quantization import QuantizationPlan, quantize_model
from ..models.assistant import Assistant, AssistantConfig
from ..variants import VARIANTS
from .speed import CPU_LAYERS, build_pair, narrow, run_mlx_lm, run_ours
from .step import _copy

DRAFTER_WIDTH = 256


def random_drafter(text: dict, bits: int | None, dtype=mx.bfloat16) -> Assistant:
    """A drafter with random weights shaped for a target of text config ``text``: 4 layers reading
    its K/V, the centroid head on E2B/E4B-like targets (those with per-layer embeddings)."""
    own = dict(text, hidden_size=DRAFTER_WIDTH, intermediate_size=4 * DRAFTER_WIDTH, num_hidden_layers=4,
               layer_types=[SLIDING, SLIDING, SLIDING, FULL], hidden_size_per_layer_input=0, num_kv_shared_layers=0,
               enable_moe_block=False, use_double_wide_mlp=False)  # fmt: skip
    ordered = bool(text.get("hidden_size_per_layer_input"))
    centroids = 2048 if text["vocab_size"] % 2048 == 0 else 8
    config = AssistantConfig(TextConfig.from_dict(own), backbone_hidden_size=text["hidden_size"], use_ordered_embeddings=ordered,
                             num_centroids=centroids, centroid_intermediate_top_k=min(32, centroids // 4))  # fmt: skip
    drafter = Assistant(config)
    drafter.set_dtype(dtype)
    if ordered:
        order = np.random.default_rng(0).permutation(text["vocab_size"]).astype(np.int32)
        drafter.masked_embedding.token_ordering = mx.array(order)
    if bits:
        quantize_model(drafter, QuantizationPlan(bits, 64, "affine"))
    drafter.materialize()
    return drafter


class AgreeingDrafter:
    """Runs ``drafter`` (its cost is paid) but proposes ``continuation``, the target's own greedy
    tokens after a prompt of ``start`` tokens, looked up on the device (no host sync)."""

    def __init__(self, drafter: Assistant, continuation: list[int], start: int, vocab: int):
        self.drafter, self.layer_types = drafter, drafter.layer_types
        self.table = mx.array(continuation + [0] * 64)
        self.start, self.vocab = start, vocab
        self._round, self._step = None, 0

    def __call__(self, inputs_embeds, kv, position):
        self._step = self._step + 1 if position is self._round else 0  # one position array per round
        self._round = position
        logits, state = self.drafter(inputs_embeds, kv, position)
        token = self.table[position + 1 + self._step - self.start]
        agreeing = (mx.arange(self.vocab) == token).astype(logits.dtype) * 20.0
        return logits * 0 + agreeing, state


def _speculative_run(model, drafter, prompt, n: int, k: int) -> tuple[float, SpeculativeStats, list[int]]:
    stats = SpeculativeStats()
    tokens, first = [], None
    mx.synchronize()
    for t, _ in speculative_tokens(model, drafter, prompt, model.make_cache(sliding_slack=1), n, make_sampler(0.0), num_draft_tokens=k, stats=stats):
        tokens.append(t)
        if first is None:
            first = time.perf_counter()
    tps = (len(tokens) - 1) / (time.perf_counter() - first)
    return tps, stats, tokens


def verify_over_decode(model, prompt, k: int, repeats: int = 5) -> float:
    """Time of a target forward over ``k + 1`` tokens / time of a one-token step, same cache."""
    cache = model.make_cache(sliding_slack=1)
    mx.eval(model.forward(prompt[None], cache))
    times = {1: [], k + 1: []}
    for _ in range(repeats):
        for n in times:
            c = _copy(cache)
            tic = time.perf_counter()
            mx.eval(model.forward(prompt[None, :n], c))
            times[n].append(time.perf_counter() - tic)
    return statistics.median(times[k + 1]) / statistics.median(times[1])


def main(argv: list[str] | None = None) -> list[dict]:
    on_gpu = mx.default_device().type == mx.DeviceType.gpu
    p = argparse.ArgumentParser(prog="python -m gemma4_mlx.bench --speculative", description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="+", default=["e2b", "31b"], choices=list(VARIANTS))
    p.add_argument("--layers", type=int, default=None, help="layers per target (default: all on a GPU, the speed bench's CPU counts on a CPU)")
    p.add_argument("--bits", type=int, default=4 if on_gpu else 0, help="quantization bits (0: bf16)")
    p.add_argument("--draft-tokens", type=int, nargs="+", default=[2, 4])
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--gen-tokens", type=int, default=128 if on_gpu else 24)
    p.add_argument("--vocab", type=int, default=262_144)
    p.add_argument("--narrow", action="store_true", help="small widths, same layers (a quick check, not a measurement)")
    args = p.parse_args(argv)

    print(f"device: {mx.default_device()}, mlx {mx.__version__}, {f'{args.bits}-bit' if args.bits else 'bf16'}, "
          f"prompt {args.prompt_tokens}, generate {args.gen_tokens}, drafter width {DRAFTER_WIDTH}")  # fmt: skip
    print(HEADER)
    rows = []
    for name in args.variants:
        layers = args.layers or (None if on_gpu else CPU_LAYERS[name])
        ours, theirs, text = build_pair(name, layers, args.bits or None, vocab_size=args.vocab, edit=narrow if args.narrow else None)
        prompt = mx.random.randint(0, text["vocab_size"], (args.prompt_tokens,), key=mx.random.key(0))
        run_ours(ours, prompt[:8], 2)
        plain = run_ours(ours, prompt, args.gen_tokens)
        lm = run_mlx_lm(theirs, prompt, args.gen_tokens)
        drafter = random_drafter(text, args.bits or None)
        greedy = [t for t, _ in generate_tokens(ours, prompt, ours.make_cache(), args.gen_tokens + 64, make_sampler(0.0))]
        agreeing = AgreeingDrafter(drafter, greedy, prompt.size, text["vocab_size"])
        for k in args.draft_tokens:
            cost = verify_over_decode(ours, prompt, k)
            rand_tps, rand_stats, _ = _speculative_run(ours, drafter, prompt, args.gen_tokens, k)
            agree_tps, agree_stats, agree_tokens = _speculative_run(ours, agreeing, prompt, args.gen_tokens, k)
            assert agree_tokens == greedy[: len(agree_tokens)], "speculative decoding changed the greedy tokens"
            row = dict(variant=name, layers=text["num_hidden_layers"], k=k, cost=cost, plain=plain.decode_tps, mlx_lm=lm.decode_tps,
                       random=(rand_tps, rand_stats), agreeing=(agree_tps, agree_stats))  # fmt: skip
            rows.append(row)
            print(_row(row), flush=True)
        del ours, theirs, drafter, agreeing
        gc.collect()
        mx.clear_cache()
    return rows


HEADER = (
    "| variant | layers | K | verify / decode cost | decode tok/s: mlx-lm / ours | random drafter: tok/s, steps per token "
    "| agreeing drafter: tok/s, steps per token |\n|---|---|---|---|---|---|---|"
)


def _row(r: dict) -> str:
    (rt, rs), (at, as_) = r["random"], r["agreeing"]
    return (
        f"| {r['variant']} | {r['layers']} | {r['k']} | {r['cost']:.2f}x | {r['mlx_lm']:.1f} / {r['plain']:.1f} "
        f"| {rt:.1f} ({rt / r['plain']:.2f}x), {1 / rs.tokens_per_step:.2f} | {at:.1f} ({at / r['plain']:.2f}x), {1 / as_.tokens_per_step:.2f} |"
    )


if __name__ == "__main__":
    main()
