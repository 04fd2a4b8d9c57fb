"""Chat and the app on a model shared by processes (``mlx.launch -n 2|3``, ring backend over
localhost): process 0 takes the requests, the others follow (gemma4_mlx/distributed/lockstep.py).
Replies equal one process's, turn after turn with prefix reuse, media, a reply stopped early, seeded
and unseeded sampling and a request that fails; every process ends with the same caches."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from checkpoints import AUDIO, SMALL_VIT, build_hf_assistant, build_hf_model, save_checkpoint
from helpers import random_image, tone
from test_distributed import ring

from gemma4_mlx import Chat
from gemma4_mlx.loading import load

WORKER = Path(__file__).parent / "chat_worker.py"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    import soundfile

    root = tmp_path_factory.mktemp("sharded_chat")
    random_image(90, 60, 0).save(root / "a.png")
    soundfile.write(root / "a.wav", tone(0.5), 16000)
    return {
        "e2b_mm": save_checkpoint(build_hf_model("e2b", vision_config=SMALL_VIT, audio_config=AUDIO), root / "e2b_mm"),
        "moe26b": save_checkpoint(build_hf_model("moe26b"), root / "moe26b"),
        "moe26b_6h": save_checkpoint(build_hf_model("moe26b", num_attention_heads=6, num_key_value_heads=3), root / "moe26b_6h"),
        "dense31b": save_checkpoint(build_hf_model("dense31b"), root / "dense31b"),
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
    chat = Chat(model, processor, draft_model=script.get("draft"), max_tokens=script["max_tokens"])
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
    ("e2b_mm", 2, "pipeline", "5,5"),  # the first process encodes the media (test_distributed: every one, under tensor)
    ("moe26b_6h", 3, "tensor", None),  # six heads split three ways; the stops agreed between the layers' sums
    ("dense31b", 2, "pipeline", "6,2"),  # with a drafter, whose sources are gathered to process 0
])  # fmt: skip
def test_a_sharded_chat_replies_as_one_process(folders, model, n, parallel, split, tmp_path):
    s = {**script(folders["media"], images=model == "e2b_mm"), "split": split}
    if model == "dense31b":
        build_hf_assistant("dense31b").save_pretrained(tmp_path / "drafter")
        s["draft"] = str(tmp_path / "drafter")
    cmd = [*ring(n), sys.executable, str(WORKER), str(folders[model]), parallel, json.dumps(s)]
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
    if "draft" in s:
        assert all("drafts" in l["summary"] for l in leader if "summary" in l)
    assert all(len(l["processes"]) == n and all(p[0] > 0 for p in l["processes"]) for l in leader if "processes" in l)
    caches = {l["rank"]: l["caches"] for l in lines if "caches" in l}
    assert sorted(caches) == list(range(n)) and all(c == caches[0] for c in caches.values())
    if model == "e2b_mm":
        assert "request failed: MediaError" in done.stderr  # the followers' side of the failed request


def test_followers_wait_through_idle_time_and_stop_when_process_0_dies(folders, tmp_path):
    """Processes started by hand (no mlx.launch to stop the rest), a 4 s limit: process 0's heartbeats
    keep its follower waiting through 6 s without requests; when process 0 dies, the follower says so
    and stops."""
    from test_distributed import free_ports

    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(2)]))
    s = {"turns": [{"text": "hello"}, {"sleep": 6}, {"text": "still there?"}, {"die": True}], "max_tokens": 4}
    env = {**os.environ, "GEMMA4_MLX_DISTRIBUTED_TIMEOUT": "4", "MLX_HOSTFILE": str(hostfile)}
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(folders["moe26b"]), "pipeline", json.dumps(s)], env={**env, "MLX_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]  # fmt: skip
    began = time.monotonic()
    (out0, err0), (out1, err1) = [p.communicate(timeout=120) for p in procs]
    assert procs[0].returncode == 3, err0[-2000:]
    assert len([l for l in out0.splitlines() if '"reply"' in l]) == 2  # both turns, across the idle time
    # Here the ring backend sees the socket close (a machine that vanishes is caught by the time limit).
    assert procs[1].returncode != 0 and "PeerLostError: process 1 of 2: another process stopped or cannot be reached" in err1, err1[-2000:]
    assert time.monotonic() - began < 60


def test_a_follower_whose_leader_freezes_stops_within_the_limit(folders, tmp_path):
    """Process 0 frozen (SIGSTOP: its sockets stay open, as with a Mac asleep or a cable pulled):
    no heartbeat comes, and its follower stops with a message after the 4 s limit."""
    from test_distributed import free_ports

    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(2)]))
    s = {"turns": [{"text": "hello"}, {"sleep": 60}], "max_tokens": 4}
    env = {**os.environ, "GEMMA4_MLX_DISTRIBUTED_TIMEOUT": "4", "MLX_HOSTFILE": str(hostfile)}
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(folders["moe26b"]), "pipeline", json.dumps(s)], env={**env, "MLX_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]  # fmt: skip
    try:
        assert '"reply"' in procs[0].stdout.readline()  # the first turn is done: process 0 now idles
        procs[0].send_signal(signal.SIGSTOP)
        frozen = time.monotonic()
        _, err = procs[1].communicate(timeout=60)
        assert procs[1].returncode == 75, err[-2000:]
        assert "error: process 1 of 2: waiting for process 0 got no answer from the other processes in 4 s" in err
        assert time.monotonic() - frozen < 15
    finally:
        procs[0].kill()
        procs[0].communicate()


def test_the_app_under_mlx_launch_serves_from_process_0(folders):
    """``mlx.launch -n 2 python -m app --api-only --parallel tensor``: process 0 serves the API, the
    other follows; a reply (plain and streamed) equals one process's; stopping the launch stops both."""
    import urllib.error
    import urllib.request

    from test_distributed import free_ports

    port = free_ports(1)[0]
    args = ["-m", "app", "--model", str(folders["moe26b"]), "--api-only", "--port", str(port), "--parallel", "tensor", "--no-draft"]
    launch = subprocess.Popen([*ring(2), sys.executable, *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "temperature": 0}

    def post(payload: dict) -> tuple[int, str]:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(payload).encode(),
                                         {"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except OSError:
            return 0, ""  # not listening yet

    try:
        deadline = time.monotonic() + 120
        while (reply := post(body))[0] != 200:
            assert time.monotonic() < deadline and launch.poll() is None, reply
            time.sleep(0.5)
        model, processor = load(folders["moe26b"])
        expected = Chat(model, processor).ask("hello", max_tokens=8)
        assert json.loads(reply[1])["choices"][0]["message"]["content"] == expected and expected
        status, events = post({**body, "stream": True})
        deltas = [json.loads(l[6:])["choices"][0]["delta"].get("content", "") for l in events.splitlines()
                  if l.startswith("data: {") and json.loads(l[6:])["choices"]]  # fmt: skip
        assert status == 200 and "".join(deltas) == expected
    finally:
        os.killpg(launch.pid, signal.SIGTERM)
        _, err = launch.communicate(timeout=30)
    assert "python -m app (process 1): Ready" in err and "tensor over 2 processes (every layer split)" in err and "following process 0" in err
