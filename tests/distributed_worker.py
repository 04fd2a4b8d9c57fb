"""One process of a distributed test run, started by ``mlx.launch`` (see test_distributed.py):
``python distributed_worker.py '<json list of requests>'``. For each request it loads its part of
the model, generates greedily and prints one JSON line: the request's index, its rank, the tokens,
and its memory (MLX's active bytes the loading added, and the bytes of the weights it holds).
``"die": [rank, n]`` makes that process exit after its n-th token.
Several requests share one launch: starting the processes is most of a small run's time."""

import gc
import json
import os
import sys

import mlx.core as mx
from mlx.utils import tree_flatten

from gemma4_mlx.distributed import load_sharded, world
from gemma4_mlx.generation.stream import stream_generate


def main() -> None:
    group = world()
    for index, request in enumerate(json.loads(sys.argv[1])):
        before = mx.get_active_memory()
        model, processor = load_sharded(request["model"], group, parallel=request.get("parallel", "pipeline"), split=request.get("split"))
        loaded = mx.get_active_memory() - before
        weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        tokens = []
        for chunk in stream_generate(model, processor, request["prompt"], **request.get("options", {})):
            tokens.append(chunk.token)
            if request.get("die") == [group.rank(), len(tokens)]:  # [rank, tokens]: a process that dies
                os._exit(3)
        print(json.dumps({"index": index, "rank": group.rank(), "tokens": tokens, "active": loaded, "weights": weights}), flush=True)
        del model, processor
        gc.collect()
        mx.clear_cache()


if __name__ == "__main__":
    main()
