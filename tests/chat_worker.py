"""One process of a sharded chat test (see test_distributed_chat.py), started by ``mlx.launch``:
``python chat_worker.py <model> <parallel> '<json script>'``. Process 0 runs the script's turns
through :class:`gemma4_mlx.Chat` and prints one JSON line per turn (its reply, the tokens reused, the
finish reason); the others follow (``chat.follow()``) and print their caches when process 0 is done.
A turn ``{"sleep": s}`` idles, ``{"die": true}`` ends process 0 abruptly."""

import json
import os
import sys
import time

from gemma4_mlx import Chat
from gemma4_mlx.distributed import load_sharded, world


def main() -> None:
    path, parallel, script = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    group = world()
    model, processor = load_sharded(path, group, parallel=parallel, split=script.get("split"))
    chat = Chat(model, processor, draft_model=script.get("draft"), max_tokens=script.get("max_tokens", 12))
    if group.rank() != 0:
        chat.follow()
        print(json.dumps({"rank": group.rank(), "caches": cached_ids(chat)}), flush=True)
        return
    for turn in script["turns"]:
        if "sleep" in turn:  # idle: only heartbeats keep the others waiting
            time.sleep(turn["sleep"])
            continue
        if turn.get("die"):
            os._exit(3)
        options = dict(turn.get("options", {}))
        stop_after = options.pop("stop_after", None)
        chunk, count = None, 0
        try:
            for chunk in chat.send(turn["text"], images=turn.get("images", ()), audio=turn.get("audio", ()), **options):
                count += 1
                if stop_after is not None and count >= stop_after:
                    break  # a client that goes away: the others must stop at the same token
        except Exception as e:
            print(json.dumps({"rank": 0, "error": f"{type(e).__name__}: {e}"}), flush=True)
            continue
        if stop_after is not None:
            chat.messages.pop()  # the turn left early is not kept (as the app's stop does)
            print(json.dumps({"rank": 0, "stopped": True}), flush=True)
            continue
        stats = chat.last_stats
        print(json.dumps({"rank": 0, "reply": chat.last_reply.content, "reused": stats.reused_tokens,
                          "prompt": stats.prompt_tokens, "finish": chunk.finish_reason, "summary": stats.summary(),
                          "processes": [[p.peak_memory, p.traffic.transfers, p.traffic.bytes] for p in stats.processes]}), flush=True)  # fmt: skip
    print(json.dumps({"rank": 0, "caches": cached_ids(chat)}), flush=True)
    chat.engine.close()


def cached_ids(chat) -> list[list[int]]:
    """The token ids each kept KV cache holds: the same on every process when they ran alike."""
    return [list(c.ids) for c in chat.engine.caches.caches]


if __name__ == "__main__":
    main()
