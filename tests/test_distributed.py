"""Gemma 4 across processes with mx.distributed: ``mlx.launch -n 2`` and ``-n 3`` with the ring
backend over localhost (MLX's CPU backend here) give the greedy tokens of one process, for the three
shape families (a split between a KV-shared layer and its source; MoE), chunked prefill, a quantized
KV cache and a multimodal prompt; each process holds only its part of the weights."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from checkpoints import AUDIO, SMALL_VIT, build_hf_model, save_checkpoint
from helpers import random_image, tone

import gemma4_mlx
from gemma4_mlx.config import ModelConfig
from gemma4_mlx.distributed import split_layers
from gemma4_mlx.distributed.pipeline import PipelineStage, parse_split
from gemma4_mlx.errors import OptionError
from gemma4_mlx.generation.stream import stream_generate

WORKER = Path(__file__).parent / "distributed_worker.py"
LAUNCH = Path(sys.executable).parent / "mlx.launch"


def ring(n: int) -> list[str]:
    """``mlx.launch`` of ``n`` processes over the ring backend, on ports of their own (the ones a
    launch just before used may still be closing)."""
    import random

    return [str(LAUNCH), "-n", str(n), "--backend", "ring", "--starting-port", str(random.randrange(20000, 60000))]


def launch(n: int, requests: list[dict], timeout: float = 300) -> list[list[dict]]:
    """Run the worker in ``n`` processes over ``requests``; per request, the processes' JSON lines by rank."""
    cmd = [*ring(n), sys.executable, str(WORKER), json.dumps(requests)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=os.environ.copy())
    lines = [json.loads(l) for l in done.stdout.splitlines() if l.startswith("{")]
    assert done.returncode == 0 and len(lines) == n * len(requests), f"rc {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    return [sorted((l for l in lines if l["index"] == i), key=lambda l: l["rank"]) for i in range(len(requests))]


def single_process(path, prompt, options) -> list[int]:
    model, processor = gemma4_mlx.load(path)
    return [c.token for c in stream_generate(model, processor, prompt, **options)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("distributed")
    paths = {name: save_checkpoint(build_hf_model(name), root / name) for name in ("e2b", "moe26b", "dense31b")}
    paths["e2b_mm"] = save_checkpoint(build_hf_model("e2b", vision_config=SMALL_VIT, audio_config=AUDIO), root / "e2b_mm")
    # Six heads split three ways (the published variants' 8/16/32 split 2 or 4 ways); MLP and experts
    # of 64 and 32 hidden units do not split evenly.
    paths["e2b_6h"] = save_checkpoint(build_hf_model("e2b", num_attention_heads=6), root / "e2b_6h")
    paths["moe26b_6h"] = save_checkpoint(build_hf_model("moe26b", num_attention_heads=6, num_key_value_heads=3), root / "moe26b_6h")
    from convert import convert

    # float32 activations: in bf16 the parts of a split matmul round before they are summed (see README)
    paths["dense31b_4bit"] = convert(str(paths["dense31b"]), root / "dense31b_4bit", dtype="float32", quantize=True, q_group_size=32,
                                     progress=lambda _: None)  # fmt: skip
    return paths


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """A chat message with an image and a clip, as files."""
    import soundfile

    folder = tmp_path_factory.mktemp("media")
    random_image(90, 60, 0).save(folder / "a.png")
    soundfile.write(folder / "a.wav", tone(0.5), 16000)
    return [{"role": "user", "content": [{"type": "image", "path": str(folder / "a.png")},
                                         {"type": "audio", "path": str(folder / "a.wav")},
                                         {"type": "text", "text": "What is this?"}]}]  # fmt: skip


PROMPT = [2] + list(range(10, 70))  # longer than the windows (8, 16): the rings wrap
# (model, processes, parallel, split, prompt, options); one launch per process count runs them all.
CASES = [
    ("e2b", 2, "pipeline", "6,4", PROMPT, {}),  # the KV-shared layers' two sources cross the split
    ("e2b", 2, "pipeline", "5,5", PROMPT, {"prefill_step_size": 7}),  # one source crosses; chunked prefill
    ("moe26b", 2, "pipeline", None, PROMPT, {}),  # split by memory (even here)
    ("e2b_mm", 2, "pipeline", "5,5", "media", {"max_soft_tokens": 70}),  # the first process encodes
    ("e2b", 2, "tensor", None, PROMPT, {}),  # one K/V head: every process computes it
    ("moe26b", 2, "tensor", None, PROMPT, {"prefill_step_size": 16}),  # experts split; K/V heads split
    ("dense31b", 2, "tensor", None, PROMPT, {"kv_bits": 8, "kv_group_size": 32}),
    ("dense31b_4bit", 2, "tensor", None, PROMPT, {}),  # quantized rows and columns
    ("e2b_mm", 2, "tensor", None, "media", {"max_soft_tokens": 70}),
    ("e2b", 3, "pipeline", "5,1,4", PROMPT, {}),  # layer 4's K/V pass through the middle process
    ("dense31b", 3, "pipeline", "3,3,2", PROMPT, {"kv_bits": 8, "kv_group_size": 32}),
    ("e2b_6h", 3, "tensor", None, PROMPT, {}),  # KV-shared layers; 96 and 192 hidden units
    ("moe26b_6h", 3, "tensor", None, PROMPT, {"prefill_step_size": 16}),  # 64 and 32 hidden units: uneven
    ("dense31b", 4, "tensor", None, PROMPT, {}),  # 2 K/V heads on 4: each process keeps the one its query head reads
]
IDS = [f"{c[0]}-{c[1]}x-{c[2]}-{c[3] or 'auto'}" for c in CASES]


@pytest.fixture(scope="module")
def runs(checkpoints, media):
    """Every case's lines per rank, by case id: one launch of 2 processes, one of 3."""
    results = {}
    for n in (2, 3, 4):
        cases = [(i, c) for i, c in zip(IDS, CASES) if c[1] == n]
        requests = [{"model": str(checkpoints[m]), "parallel": parallel, "split": split, "prompt": media if p == "media" else p,
                     "options": {"max_tokens": 16, **o}} for _, (m, _, parallel, split, p, o) in cases]  # fmt: skip
        results.update(zip([i for i, _ in cases], launch(n, requests)))
    return results


def test_layer_splits():
    assert split_layers(10, 3) == [4, 3, 3]
    assert split_layers(35, 2, memory=[64, 32]) == [23, 12]  # a 64 GB and a 32 GB Mac
    assert split_layers(4, 3, memory=[1000, 1, 1]) == [2, 1, 1]  # everyone gets a layer
    assert parse_split("3,4,3", 3, 10) == [3, 4, 3]
    for bad in ("3,3", "5,5,0", "a,b,c"):
        with pytest.raises(OptionError):
            parse_split(bad, 3, 10)
    with pytest.raises(OptionError, match="at least one layer"):
        split_layers(2, 3)


class FakeGroup:
    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def test_kv_shared_layers_get_their_sources_kv_across_a_split(checkpoints):
    """E2B-like: 10 layers, the last 4 read layer 5's (sliding) and layer 4's (full) K/V."""
    config = ModelConfig.from_file(checkpoints["e2b"] / "config.json").text_config
    assert {s.kv_source for s in config.layers if s.is_kv_shared} == {4, 5}
    stages = [PipelineStage(FakeGroup(r, 3), config, [5, 1, 4]) for r in range(3)]
    assert [(s.start, s.end) for s in stages] == [(0, 5), (5, 6), (6, 10)]
    # Layer 4's K/V pass through the middle process (which keeps no copy), beside its own layer 5's.
    assert stages[0].crossing(5) == [4] and stages[1].mirrors == [] and stages[1].crossing(6) == [4, 5]
    assert stages[2].mirrors == [4, 5] and stages[2].cached_here(4) and not stages[1].cached_here(4)
    assert stages[2].reference_layer("sliding_attention") == 5 and stages[2].reference_layer("full_attention") == 4
    split = [PipelineStage(FakeGroup(r, 2), config, [4, 6]) for r in range(2)]
    assert split[1].mirrors == [] and split[0].crossing(4) == []  # both sources beside their readers
    assert split[0].keeps("language_model.layers.3.mlp.down_proj.weight") and not split[1].keeps("language_model.layers.3.mlp.down_proj.weight")
    assert split[0].keeps("language_model.embed_tokens_per_layer.weight") and not split[1].keeps("language_model.embed_tokens_per_layer.weight")
    assert all(s.keeps("language_model.embed_tokens.weight") for s in split)  # the tied LM head, everywhere


@pytest.mark.parametrize("case", IDS)
def test_pipeline_gives_the_tokens_of_one_process(checkpoints, media, runs, case):
    model, n, parallel, split, prompt, options = CASES[IDS.index(case)]
    expected = single_process(checkpoints[model], media if prompt == "media" else prompt, {"max_tokens": 16, **options})
    assert expected
    for line in runs[case]:
        assert line["tokens"] == expected, line["rank"]


def test_each_process_holds_only_its_part_of_the_weights(checkpoints, runs):
    """Weights held per process: its layers, plus the embeddings and final norm every process has
    (the tied LM head) and, on the first, the per-layer inputs' projection. MLX's active memory
    after loading is those weights: the other layers' are never read."""
    from mlx.utils import tree_flatten

    model, _ = gemma4_mlx.load(checkpoints["e2b"])
    sizes = {k: v.nbytes for k, v in tree_flatten(model.parameters())}
    total = sum(sizes.values())
    later = sum(v for k, v in sizes.items() if any(k.startswith(f"language_model.layers.{i}.") for i in range(6, 10)))
    shared = sizes["language_model.embed_tokens.weight"] + sizes["language_model.norm.weight"]
    lines = runs["e2b-2x-pipeline-6,4"]
    assert [l["weights"] for l in lines] == [total - later, later + shared]
    for line in lines:
        assert line["weights"] <= line["active"] <= 1.05 * line["weights"] + 256 * 1024, line


def test_tensor_parallelism_splits_every_layer(checkpoints, runs):
    """Each process holds half of every layer's projections (K/V too where the heads divide) and
    the whole of the rest; a split that does not divide is refused."""
    from mlx.utils import tree_flatten

    from gemma4_mlx.distributed.tensor import check_divisible

    model, _ = gemma4_mlx.load(checkpoints["dense31b"], merge_projections=False)
    sizes = {k: v.nbytes for k, v in tree_flatten(model.parameters())}

    def halved(name: str) -> bool:  # the full layers' single K/V head stays whole
        if not name.startswith("language_model.layers.") or not name.endswith("proj.weight"):
            return False
        spec = model.text_config.layers[int(name.split(".")[2])]
        return not re.search(r"\.(k|v)_proj\.", name) or spec.num_kv_heads % 2 == 0

    expected = sum(v // 2 if halved(k) else v for k, v in sizes.items())
    lines = runs["dense31b-2x-tensor-auto"]
    assert lines[0]["weights"] == lines[1]["weights"] == expected < sum(sizes.values())
    with pytest.raises(OptionError, match="cannot split 4 attention heads 3 ways"):
        check_divisible(model.text_config, 3)
    # The memory estimate per machine counts the same weights, and half the sliding layers' K/V.
    from gemma4_mlx.memory import estimate, kv_cache_bytes, process_estimates

    (_, share), _ = process_estimates(checkpoints["dense31b"], 64, 2, parallel="tensor")
    text = model.text_config
    halved_kv = sum(kv_cache_bytes(text, 64, layers={s.index}) // (2 if s.num_kv_heads % 2 == 0 else 1) for s in text.layers)
    assert share.weights == expected and share.kv_cache == halved_kv < estimate(checkpoints["dense31b"], 64).kv_cache
    for line in lines:
        assert line["weights"] <= line["active"] <= 1.05 * line["weights"] + 256 * 1024, line


def test_each_process_counts_its_traffic(runs):
    """Transfers and bytes per process, counted as the forward passes are built: a pipeline process
    sends or receives one array and gathers one per forward pass; tensor parallelism sums two arrays
    per layer (three with MoE), each the width of the residual stream (fp32 here)."""
    hidden = 64 * 4
    for case, per_forward in (("e2b-2x-tensor-auto", 2 * 10), ("moe26b-2x-tensor-auto", 3 * 6)):
        lines = runs[case]
        assert lines[0]["transfers"] == lines[1]["transfers"] > 0 and lines[0]["transfers"] % per_forward == 0
        assert lines[0]["bytes"] % hidden == 0 and lines[0]["bytes"] >= lines[0]["transfers"] * hidden
        assert lines[0]["link_s"] > 0
    first, last = runs["e2b-2x-pipeline-6,4"]
    assert first["transfers"] == last["transfers"] > 0 and first["transfers"] % 2 == 0  # a send (receive) and a gather
    assert first["bytes"] == last["bytes"]


def test_kv_heads_each_process_keeps():
    """The K/V heads a process keeps, for the published variants' head counts: an equal share where
    they divide, the single one, or the one its query heads read (E4B, and the 26B's and 31B's full
    layers, on more processes than K/V heads)."""
    from gemma4_mlx.distributed.tensor import kv_heads_kept

    assert [kv_heads_kept(32, 16, 2, r) for r in range(2)] == [(0, 8), (8, 8)]  # 31B sliding layers
    assert [kv_heads_kept(8, 1, 4, r) for r in range(4)] == [(0, 1)] * 4  # E2B: every process computes it
    assert [kv_heads_kept(8, 2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]  # E4B
    assert [kv_heads_kept(32, 4, 8, r)[0] for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]  # 31B full layers on 8
    assert kv_heads_kept(8, 2, 3, 0) is None and kv_heads_kept(16, 8, 32, 0) is None  # 16 query heads on 32


def test_hidden_units_split_at_quantization_groups():
    from gemma4_mlx.distributed.tensor import split_points

    assert split_points(704, 2, 64) == [0, 384, 704]  # the 26B's experts: 11 groups of 64
    assert split_points(64, 3) == [0, 22, 43, 64]
    assert split_points(21504, 4, 64) == [0, 5376, 10752, 16128, 21504]
    with pytest.raises(OptionError, match="cannot split 32 hidden units 2 ways in groups of 32"):
        split_points(32, 2, 32)


def test_sharded_generation_from_the_command_line(checkpoints):
    """``mlx.launch -n 2 python -m gemma4_mlx --split ...``: the text of one process, printed once."""
    model, processor = gemma4_mlx.load(checkpoints["moe26b"])
    expected = gemma4_mlx.generate(model, processor, [{"role": "user", "content": "hello"}], max_tokens=12)
    args = ["--model", str(checkpoints["moe26b"]), "--prompt", "hello", "--max-tokens", "12", "--split", "2,4"]
    cmd = [*ring(2), sys.executable, "-m", "gemma4_mlx", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == expected + "\n" and expected
    assert "rank 0: layers 0-1, rank 1: layers 2-5" in done.stderr
    assert "[rank 0] prompt:" in done.stderr and "[rank 1] prompt:" in done.stderr  # each process's statistics
    assert "communication: " in done.stderr and "on the link" in done.stderr


def test_tensor_parallel_speculative_generation_from_the_command_line(checkpoints, tmp_path):
    """``mlx.launch -n 2 gemma4-generate --parallel tensor --draft-model ...``: one process's text."""
    from checkpoints import build_hf_assistant

    build_hf_assistant("moe26b").save_pretrained(tmp_path / "drafter")
    model, processor = gemma4_mlx.load(checkpoints["moe26b"])
    expected = gemma4_mlx.generate(model, processor, [{"role": "user", "content": "hello"}], max_tokens=12)
    args = ["--model", str(checkpoints["moe26b"]), "--prompt", "hello", "--max-tokens", "12", "--parallel", "tensor",
            "--draft-model", str(tmp_path / "drafter")]  # fmt: skip
    cmd = [*ring(2), sys.executable, "-m", "gemma4_mlx", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == expected + "\n" and expected
    assert "tensor over 2 processes: every layer split" in done.stderr and "drafts: " in done.stderr


def free_ports(n: int) -> list[int]:
    import socket

    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def test_a_dead_or_unreachable_peer_stops_the_others_with_a_message(checkpoints, tmp_path):
    """Processes started by hand (no mlx.launch to stop the rest): when process 1 dies mid-reply,
    process 0 says so and exits within the limit, in a pipeline and under tensor parallelism; a
    process whose peer never starts says it could not connect. (MLX's ring backend alone would wait
    forever in the first and last cases.)"""
    import time

    env = {**os.environ, "GEMMA4_MLX_DISTRIBUTED_TIMEOUT": "4"}
    hostfiles = [tmp_path / f"{name}.json" for name in ("pair", "lone", "tensor")]
    ports = free_ports(6)
    for i, hostfile in enumerate(hostfiles):
        hostfile.write_text(json.dumps([[f"127.0.0.1:{ports[2 * i]}"], [f"127.0.0.1:{ports[2 * i + 1]}"]]))
    request = {"model": str(checkpoints["e2b"]), "split": "6,4", "prompt": PROMPT, "options": {"max_tokens": 200}, "die": [1, 3]}
    tensor = {**request, "model": str(checkpoints["dense31b"]), "parallel": "tensor", "split": None}

    def start(hostfile, rank, request=request):
        return subprocess.Popen([sys.executable, str(WORKER), json.dumps([request])], env={**env, "MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(rank)},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip

    began = time.monotonic()
    pair, lone, split = hostfiles
    processes = {"survivor": start(pair, 0), "dying": start(pair, 1), "alone": start(lone, 0),
                 "tensor survivor": start(split, 0, tensor), "tensor dying": start(split, 1, tensor)}  # fmt: skip
    outputs = {name: p.communicate(timeout=120)[1] for name, p in processes.items()}
    codes = {name: p.returncode for name, p in processes.items()}
    assert time.monotonic() - began < 100
    assert codes["dying"] == codes["tensor dying"] == 3
    # A pipeline's receive waits on a dead peer's socket: the time limit ends it.
    assert codes["survivor"] == 75, outputs["survivor"][-2000:]
    assert "error: process 0 of 2: a forward pass got no answer from the other processes in 4 s" in outputs["survivor"]
    # Tensor parallelism's sums see the socket close.
    assert codes["tensor survivor"] != 0, outputs["tensor survivor"][-2000:]
    assert "PeerLostError: process 0 of 2: another process stopped or cannot be reached" in outputs["tensor survivor"]
    assert codes["alone"] == -9, outputs["alone"][-2000:]
    assert "error: process 0 could not connect to the other processes in 4 s" in outputs["alone"]


def test_a_process_reads_and_downloads_only_its_shards(tmp_path, monkeypatch):
    """A sharded E2B-like checkpoint: process 1 of a 5,5 split needs only the shards holding layers
    5-9, the embeddings and the final norm; it loads with the other shards gone, holding only its
    part; from the Hub it asks for the config first, then those shards."""
    import shutil

    import huggingface_hub
    from mlx.utils import tree_flatten

    from gemma4_mlx.distributed import own_shards
    from gemma4_mlx.loading import load_model

    folder = save_checkpoint(build_hf_model("e2b"), tmp_path / "sharded", max_shard_size="60KB")
    config = ModelConfig.from_file(folder / "config.json").text_config
    stage = PipelineStage.planned(config, [5, 5], 1)
    mine = own_shards(folder, stage)
    everything = sorted(p.name for p in folder.glob("*.safetensors"))
    assert 1 < len(mine) < len(everything)
    for name in set(everything) - set(mine):
        (folder / name).unlink()
    model = load_model(folder, stage=stage)
    names = [k for k, _ in tree_flatten(model.parameters())]
    layers = {int(k.split(".")[2]) for k in names if k.startswith("language_model.layers.")}
    assert layers == set(range(5, 10)) and "language_model.embed_tokens.weight" in names
    assert not any("per_layer_model_projection" in k for k in names)  # the first process's

    # From the Hub: the metadata (no weights), then this process's shards.
    asked = []

    def snapshot_download(repo, revision=None, allow_patterns=(), tqdm_class=None):
        asked.append(list(allow_patterns))
        if any(p.endswith(".safetensors") and "*" not in p for p in allow_patterns):
            return str(folder)
        meta = tmp_path / "meta"
        shutil.copytree(folder, meta, ignore=shutil.ignore_patterns("*.safetensors"), dirs_exist_ok=True)
        return str(meta)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    from gemma4_mlx.loading import resolve_model_path

    meta = resolve_model_path("someone/gemma-4-e2b", weights=[])
    assert not any("safetensors" in p for p in asked[0]) and own_shards(meta, stage) == mine
    assert resolve_model_path("someone/gemma-4-e2b", weights=mine) == folder and asked[1][-len(mine) :] == mine
