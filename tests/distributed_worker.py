"""One process of a distributed test run, started by ``mlx.launch`` (see test_distributed.py):
``python distributed_worker.py '<json list of requests>'``. For each request it loads its part of
the model, generates greedily and prints one JSON line: the request's index, its rank, the tokens,
and its memory (MLX's active bytes the loading added, and the bytes of the weights it holds).
``"die": [rank, n]`` makes that process exit after its n-th token; ``"draft"`` (a drafter folder) and
``"num_draft_tokens"`` decode speculatively (the line then has the drafted and accepted counts);
``"agree"`` (the greedy tokens) makes that drafter propose them most of the time (see :func:`agreeing`).
Several requests share one launch: starting the processes is most of a small run's time."""

import gc
import json
import os
import sys

import mlx.core as mx
from mlx.utils import tree_flatten

from gemma4_mlx.distributed import load_sharded, world
from gemma4_mlx.generation.stream import stream_generate
from gemma4_mlx.loading.assistant import load_drafter


def agreeing(drafter, tokens: list[int], start: int):
    """``drafter`` proposing the known greedy ``tokens`` unless a hash of its own logits is 0 mod 3
    (then its own choice): rounds keep some drafts, and how many depends on the drafter's exact
    output, so that processes drafting apart would part ways."""
    expected, seen = mx.array(tokens + [0] * 64), {"position": None, "step": 0}

    class Agreeing(type(drafter)):
        def __call__(self, inputs_embeds, kv, position):
            logits, state = super().__call__(inputs_embeds, kv, position)
            seen["step"] = seen["step"] + 1 if position is seen["position"] else 0  # drafting on in a round
            seen["position"] = position
            bits = logits.view(mx.uint16 if logits.dtype.size == 2 else mx.uint32)
            own = (bits & 255).astype(mx.uint32).sum() % 3 == 0
            choice = mx.where(own, mx.argmax(logits[0, -1]), expected[position + 1 + seen["step"] - start])
            return (mx.arange(logits.shape[-1]) == choice).astype(logits.dtype)[None, None] * 20.0, state

    drafter.__class__ = Agreeing
    return drafter


def main() -> None:
    group = world()
    for index, request in enumerate(json.loads(sys.argv[1])):
        before = mx.get_active_memory()
        model, processor = load_sharded(request["model"], group, parallel=request.get("parallel", "pipeline"), split=request.get("split"))
        loaded = mx.get_active_memory() - before
        weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        tokens, draft = [], {}
        if "draft" in request:
            drafter = agreeing(load_drafter(request["draft"]), request["agree"], len(request["prompt"])) if "agree" in request else request["draft"]
            draft = {"draft_model": drafter, "num_draft_tokens": request.get("num_draft_tokens", 4)}
        for chunk in stream_generate(model, processor, request["prompt"], **draft, **request.get("options", {})):
            tokens.append(chunk.token)
            if request.get("die") == [group.rank(), len(tokens)]:  # [rank, tokens]: a process that dies
                os._exit(3)
        line = {"index": index, "rank": group.rank(), "tokens": tokens, "active": loaded, "weights": weights}
        if tokens:
            line.update(transfers=chunk.traffic.transfers, bytes=chunk.traffic.bytes, link_s=chunk.traffic.seconds)
        if draft and tokens:
            line.update(drafted=chunk.draft.drafted, accepted=chunk.draft.accepted)
        print(json.dumps(line), flush=True)
        del model, processor
        gc.collect()
        mx.clear_cache()


if __name__ == "__main__":
    main()
