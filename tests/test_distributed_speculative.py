"""Speculative decoding across processes: with a drafter, ``mlx.launch -n 2`` and ``-n 3`` (ring
backend over localhost) give the greedy tokens of one process decoding plainly, under pipeline
parallelism (every process drafts from its copies of the layers the drafter reads, whichever process
runs them) and tensor parallelism (the drafter split as the target). The drafters keep some drafts
depending on their exact output (distributed_worker.agreeing): processes drafting apart would part ways."""


import pytest
from checkpoints import build_hf_assistant, build_hf_model, save_checkpoint
from test_distributed import PROMPT, FakeGroup, launch, single_process

import mlx.core as mx
from mlx_lm.sample_utils import make_sampler

from gemma4_mlx.config import ModelConfig
from gemma4_mlx.distributed.pipeline import PipelineStage
from gemma4_mlx.errors import OptionError


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("distributed_speculative")
    paths = {}
    for name in ("e2b", "dense31b"):
        paths[name] = save_checkpoint(build_hf_model(name), root / name)
        build_hf_assistant(name, ordered=name == "e2b").save_pretrained(root / f"{name}_drafter")
        paths[f"{name}_drafter"] = root / f"{name}_drafter"
    return paths


# (model, processes, parallel, split, drafted per step, options); one launch per process count.
CASES = [
    ("e2b", 2, "pipeline", "6,4", 3, {}),  # the sources (4, 5) on rank 0; rank 1's KV-shared layers copy them already
    ("e2b", 2, "pipeline", "3,7", 4, {"prefill_step_size": 7}),  # the sources on the last rank: gathered to rank 0
    ("dense31b", 2, "pipeline", None, 2, {}),  # a K=V source (7): its values and k_norm weight gathered
    ("dense31b", 2, "pipeline", "5,3", 3, {"kv_bits": 8, "kv_group_size": 32}),  # keys made from quantized values
    ("e2b", 2, "tensor", None, 3, {}),  # one K/V head: every process reads it whole
    ("dense31b", 2, "tensor", None, 4, {}),  # sliding K/V heads split: the drafter's query heads follow
    ("e2b", 3, "pipeline", "5,1,4", 3, {}),  # 5 gathered to rank 0; 4 reaches rank 1 along the pipeline
]
IDS = [f"{c[0]}-{c[1]}x-{c[2]}-{c[3] or 'auto'}-k{c[4]}" for c in CASES]


@pytest.fixture(scope="module")
def plain(folders):
    """Each case's greedy tokens from one process decoding plainly."""
    return {i: single_process(folders[c[0]], PROMPT, {"max_tokens": 16, **c[5]}) for i, c in zip(IDS, CASES)}


@pytest.fixture(scope="module")
def runs(folders, plain):
    results = {}
    for n in (2, 3):
        cases = [(i, c) for i, c in zip(IDS, CASES) if c[1] == n]
        requests = [{"model": str(folders[m]), "parallel": parallel, "split": split, "prompt": PROMPT, "draft": str(folders[f"{m}_drafter"]),
                     "agree": plain[i], "num_draft_tokens": k, "options": {"max_tokens": 16, **o}}
                    for i, (m, _, parallel, split, k, o) in cases]  # fmt: skip
        results.update(zip([i for i, _ in cases], launch(n, requests)))
    return results


@pytest.mark.parametrize("case", IDS)
def test_speculative_decoding_across_processes_gives_plain_greedy_tokens(plain, runs, case):
    lines = runs[case]
    for line in lines:
        assert line["tokens"] == plain[case], line["rank"]
        assert (line["drafted"], line["accepted"]) == (lines[0]["drafted"], lines[0]["accepted"])  # every process drafted alike
    assert 0 < lines[0]["accepted"] < lines[0]["drafted"]  # rounds kept all, some or none of their drafts


def test_drafter_sources_reach_every_process(folders):
    """E2B-like: the drafter reads layers 5 (sliding) and 4 (full), the KV-shared layers' sources too."""
    config = ModelConfig.from_file(folders["e2b"] / "config.json").text_config

    def stages(counts):
        out = [PipelineStage(FakeGroup(r, len(counts)), config, counts) for r in range(len(counts))]
        for s in out:
            s.use_drafter_sources([4, 5])
        return out

    assert all(s.shared_sources == [] for s in stages([6, 4]))  # rank 1's KV-shared layers get them anyway
    first, _ = stages([3, 7])
    assert first.shared_sources == [4, 5] and first.mirrors == [4, 5] and first.cached_here(5) and not first.cached_here(3)
    a, b, c = stages([5, 1, 4])
    assert a.shared_sources == [5] and a.mirrors == [5] and b.mirrors == [4] and c.mirrors == [4, 5]
    dense = ModelConfig.from_file(folders["dense31b"] / "config.json").text_config
    stage = PipelineStage(FakeGroup(0, 2), dense, [4, 4])
    stage.use_drafter_sources([6, 7])
    assert stage.shared_sources == [6, 7] and stage.drafter_keys(7) is None  # made from the first gathered k_norm weight


def test_a_cache_made_before_the_drafter_is_refused(folders):
    """A pipeline process's cache made before the drafter was attached keeps no copy of its sources."""
    from gemma4_mlx.generation.speculative import load_checked_drafter, speculative_tokens
    from gemma4_mlx.loading import load_model

    config = ModelConfig.from_file(folders["e2b"] / "config.json").text_config
    model = load_model(folders["e2b"], stage=PipelineStage.planned(config, [3, 7], 0))
    early = model.make_cache(1)
    drafter = load_checked_drafter(str(folders["e2b_drafter"]), model, 3)
    with pytest.raises(OptionError, match="made before the draft model was attached.*layer 4, 5, which"):
        next(speculative_tokens(model, drafter, mx.array(PROMPT), early, 8, make_sampler(0.0)))
    cache = model.make_cache(1)  # made after: real copies of 4 and 5 (layer 3 runs elsewhere and only counts)
    assert [type(c).__name__ for c in cache[3:6]] == ["PassedLayerCache", "KVCache", "RotatingKVCache"]


def test_a_drafter_whose_heads_do_not_split_is_refused(tmp_path):
    from gemma4_mlx.distributed.tensor import shard_drafter
    from gemma4_mlx.loading.assistant import load_drafter

    build_hf_assistant("e2b", num_attention_heads=3).save_pretrained(tmp_path)
    with pytest.raises(OptionError, match="cannot split the draft model's 3 attention heads 2 ways"):
        shard_drafter(load_drafter(tmp_path), FakeGroup(0, 2))
