"""Our model against transformers 5.23 on tiny random checkpoints (fp32)."""

import mlx.core as mx
import numpy as np
import pytest
import torch

from helpers import hf_logits, random_ids, rel_err

import gemma4_mlx

SEQ = 40  # five sliding windows of the e2b/moe26b families, 2.5 of dense31b


def test_full_forward_matches_hf(any_family):
    ids = random_ids(SEQ)
    ref = hf_logits(any_family.hf, ids)
    ours = any_family.model(mx.array(ids.numpy()))
    assert ours.shape == ref.shape
    assert rel_err(ours, ref) < 1e-4


def test_batched_forward_matches_hf(any_family):
    ids = torch.cat([random_ids(SEQ, seed=1), random_ids(SEQ, seed=2)])
    assert rel_err(any_family.model(mx.array(ids.numpy())), hf_logits(any_family.hf, ids)) < 1e-4


def test_token_by_token_decoding_matches_hf(any_family):
    """Prefill a prompt, then decode one token at a time through the caches (past several windows)."""
    ids = random_ids(SEQ, seed=3)
    ref = hf_logits(any_family.hf, ids)
    cache = any_family.model.make_cache()
    prompt = 5
    out = [np.array(any_family.model(mx.array(ids[:, :prompt].numpy()), cache=cache))]
    for t in range(prompt, SEQ):
        out.append(np.array(any_family.model(mx.array(ids[:, t : t + 1].numpy()), cache=cache)))
    assert rel_err(np.concatenate(out, axis=1), ref) < 1e-4


@pytest.mark.parametrize("chunks", [[3, 7, 1, 1, 12, 1, 15], [20, 1, 1, 1, 17], [9, 9, 9, 13]])
def test_chunked_prefill_matches_hf(any_family, chunks):
    """Chunks shorter and longer than the window, mixed with single steps (multi-turn shape)."""
    assert sum(chunks) == SEQ
    ids = random_ids(SEQ, seed=4)
    ref = hf_logits(any_family.hf, ids)
    cache = any_family.model.make_cache()
    out, t = [], 0
    for n in chunks:
        out.append(np.array(any_family.model(mx.array(ids[:, t : t + n].numpy()), cache=cache)))
        t += n
    assert rel_err(np.concatenate(out, axis=1), ref) < 1e-4


def test_greedy_generation_matches_hf_generate(any_family):
    prompt = random_ids(12, seed=5)
    eos = sorted(any_family.processor.eos_token_ids)
    with torch.no_grad():
        hf_out = any_family.hf.generate(
            prompt, max_new_tokens=48, do_sample=False, eos_token_id=eos, pad_token_id=0,
            output_scores=True, return_dict_in_generate=True,
        )
    hf_tokens = hf_out.sequences[0, prompt.shape[1] :].tolist()
    ours = [c.token for c in gemma4_mlx.stream_generate(any_family.model, any_family.processor, prompt[0].tolist(), max_tokens=48)]
    assert len(hf_tokens) > 0
    for step, (a, b) in enumerate(zip(ours, hf_tokens)):
        if a != b:
            top2 = torch.topk(hf_out.scores[step][0], 2).values
            assert float(top2[0] - top2[1]) < 1e-3, f"diverged at step {step} without a near-tie"
            return
    assert len(ours) == len(hf_tokens)


def test_full_forward_in_query_blocks_matches_hf(any_family, monkeypatch):
    """With a scores budget so small that every prefill attention runs in query blocks (the
    long-context path), the logits still match transformers."""
    import gemma4_mlx.ops.blockwise as blockwise

    monkeypatch.setattr(blockwise, "SCORES_BUDGET", 4096)
    ids = random_ids(SEQ, seed=5)
    assert rel_err(any_family.model(mx.array(ids.numpy())), hf_logits(any_family.hf, ids)) < 1e-4
