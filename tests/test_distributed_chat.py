"""Chat and the app on a model shared by processes (``mlx.launch -n 2|3``, ring backend over
localhost): process 0 takes the requests, the others follow (gemma4_mlx/distributed/lockstep.py).
Replies equal one process's, turn after turn with prefix reuse, media, a reply stopped early, seeded
and unseeded sampling and a request that fails; every process ends with the same caches."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from checkpoints import AUDIO, SMALL_VIT, build_hf_model, save_checkpoint
from helpers import random_image, tone

from gemma4_mlx import Chat
from gemma4_mlx.loading import load

WORKER = Path(__file__).parent / "chat_worker.py"
LAUNCH = Path(sys.executable).parent / "mlx.launch"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    import soundfile

    root = tmp_path_factory.mktemp("sharded_chat")
    random_image(90, 60, 0).save(root / "a.png")
    soundfile.write(root / "a.wav", tone(0.5), 16000)
    return {
        "e2b_mm": save_checkpoint(build_hf_model("e2b", vision_config=SMALL_VIT, audio_config=AUDIO), root / "e2b_mm"),
        "moe26b": save_checkpoint(build_hf_model("moe26b"), root / "moe26b"),
        "media": root,
    }


def script(media: Path, images: bool) -> dict:
    turns = [
        {"text": "hello"},
        {"text": "and more"},  # reuses the first turn's cache
        {"text": "look", "images": [str(media / "a.png")], "audio": [str(media / "a.wav")], "options": {"max_soft_tokens": 70}},
        {"text": "missing", "images": [str(media / "missing.png")]},  # fails alike everywhere
        {"text": "stop please", "options": {"stop_after": 3}},  # process 0's caller leaves mid-reply
        {"text": "sample", "options": {"temperature": 0.9, "seed": 7}},
        {"text": "sample freely", "options": {"temperature": 0.9}},  # process 0 draws the seed for all
    ]
    return {"turns": [t for t in turns if images or "images" not in t], "max_tokens": 10}


def run_alone(path: Path, script: dict) -> list[dict]:
    """The script's lines in one process, through the same worker code path (Chat)."""
    model, processor = load(path)
    chat = Chat(model, processor, max_tokens=script["max_tokens"])
    lines = []
    for turn in script["turns"]:
        options = dict(turn.get("options", {}))
        stop_after = options.pop("stop_after", None)
        try:
            for count, chunk in enumerate(chat.send(turn["text"], images=turn.get("images", ()), audio=turn.get("audio", ()), **options), 1):
                if stop_after is not None and count >= stop_after:
                    break
        except Exception as e:
            lines.append({"error": f"{type(e).__name__}: {e}"})
            continue
        if stop_after is not None:
            chat.messages.pop()
            lines.append({"stopped": True})
            continue
        lines.append({"reply": chat.last_reply.content, "reused": chat.last_stats.reused_tokens})
    return lines


@pytest.mark.parametrize("model, n, parallel, split", [
    ("e2b_mm", 2, "pipeline", "5,5"),  # the first process encodes the media
    ("e2b_mm", 2, "tensor", None),  # every process encodes them (from the bytes process 0 sent)
    ("moe26b", 3, "pipeline", None),
])  # fmt: skip
def test_a_sharded_chat_replies_as_one_process(folders, model, n, parallel, split):
    s = {**script(folders["media"], images=model == "e2b_mm"), "split": split}
    cmd = [str(LAUNCH), "-n", str(n), "--backend", "ring", sys.executable, str(WORKER), str(folders[model]), parallel, json.dumps(s)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    lines = [json.loads(l) for l in done.stdout.splitlines() if l.startswith("{")]
    assert done.returncode == 0, done.stderr[-3000:]
    leader = [l for l in lines if l["rank"] == 0 and "caches" not in l]
    alone = run_alone(folders[model], s)
    assert len(leader) == len(alone) == len(s["turns"])
    for got, expected, turn in zip(leader[:-1], alone[:-1], s["turns"]):  # the last samples with its own seed
        if "error" in expected:
            assert "error" in got and "missing.png" in got["error"], got
        else:
            assert {k: got.get(k) for k in expected} == expected, turn["text"]
    assert leader[-1]["reply"] and alone[1]["reused"] > 0
    caches = {l["rank"]: l["caches"] for l in lines if "caches" in l}
    assert sorted(caches) == list(range(n)) and all(c == caches[0] for c in caches.values())
    if model == "e2b_mm":
        assert "request failed: MediaError" in done.stderr  # the followers' side of the failed request
