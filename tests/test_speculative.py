"""Speculative decoding with Gemma 4 assistants: the drafter against transformers, and the loop
against plain decoding (greedy: the same tokens; sampling: the same distribution)."""

import mlx.core as mx
import numpy as np
import pytest
import torch
from mlx_lm.sample_utils import make_sampler

from checkpoints import build_hf_assistant
from helpers import rel_err

import gemma4_mlx
from gemma4_mlx.generation.decode import generate_tokens
from gemma4_mlx.generation.speculative import SpeculativeStats, _accept, speculative_tokens
from gemma4_mlx.loading.assistant import load_drafter

PROMPT = [2, 5, 17, 99, 3, 44, 12]  # shorter than the window: transformers' first round sees the same K/V


def _drafter(ordered: bool, folder):
    hf = build_hf_assistant("e2b", ordered=ordered)
    hf.save_pretrained(folder)
    return hf, load_drafter(folder)


@pytest.fixture(scope="module")
def e2b_drafter(tmp_path_factory):
    """A random drafter for the e2b family, with the centroid head (as the E2B/E4B drafters have)."""
    return _drafter(True, tmp_path_factory.mktemp("drafter"))


@pytest.mark.parametrize("family_name", ["e2b", "moe26b", "dense31b", "unified"])
@pytest.mark.parametrize("ordered", [False, True])
def test_drafter_matches_transformers(family_name, ordered, tmp_path):
    """Logits and projected hidden state, given the same target K/V (both LM-head kinds, the K/V
    shapes of each family: 26B/31B full layers read K=V heads)."""
    hf = build_hf_assistant(family_name, ordered=ordered)
    hf.save_pretrained(tmp_path)
    ours = load_drafter(tmp_path)
    g = torch.Generator().manual_seed(3)
    specs = ours.config.layer_specs()
    kv = {}
    for spec, length in ((specs[0], 7), (specs[-1], 11)):
        shape = (1, spec.num_kv_heads, length, spec.head_dim)
        kv[spec.layer_type] = (torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    x = torch.randn(1, 1, 2 * hf.config.backbone_hidden_size, generator=g)
    with torch.no_grad():
        ref = hf(inputs_embeds=x, position_ids=torch.tensor([[11]]), shared_kv_states=kv)
    logits, projected = ours(mx.array(x.numpy()), {k: (mx.array(a.numpy()), mx.array(b.numpy())) for k, (a, b) in kv.items()}, mx.array(11))
    assert rel_err(logits, ref.logits.numpy()) < 1e-4
    assert rel_err(projected, ref.last_hidden_state.numpy()) < 1e-4


class Recording:
    """A drafter that notes the greedy token of every step it drafts."""

    def __init__(self, drafter):
        self.drafter, self.tokens = drafter, []
        self.layer_types = drafter.layer_types

    def __call__(self, *args):
        logits, state = self.drafter(*args)
        self.tokens.append(int(mx.argmax(logits[0, -1]).item()))
        return logits, state


@pytest.mark.parametrize("ordered", [False, True], ids=["dense-head", "centroid-head"])
def test_first_round_drafts_equal_transformers_candidate_generator(e2b, ordered, tmp_path):
    from transformers import GenerationConfig
    from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator

    hf_drafter, drafter = _drafter(ordered, tmp_path)
    k = 4
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = e2b.hf(input_ids=ids, output_hidden_states=True, return_shared_kv_states=True, use_cache=True)
    first = out.logits[:, -1].argmax(-1, keepdim=True)
    hf_drafter.generation_config.num_assistant_tokens = k
    generator = SinglePositionMultiTokenCandidateGenerator(hf_drafter, e2b.hf.get_input_embeddings(), GenerationConfig(max_length=64))
    with torch.no_grad():
        candidates, _ = generator.get_candidates(torch.cat([ids, first], 1), {}, out, is_first_iteration=False, n_last_matches=0)
    expected = candidates[0, len(PROMPT) + 1 :].tolist()

    recording = Recording(drafter)
    tokens = speculative_tokens(e2b.model, recording, mx.array(PROMPT), e2b.model.make_cache(1), k + 2, make_sampler(0.0), num_draft_tokens=k)
    assert next(tokens)[0] == first.item()
    next(tokens)  # the first round: k drafted tokens
    assert recording.tokens[:k] == expected


class Oracle:
    """A drafter built to agree with the target: it proposes the plain greedy continuation, except
    at the positions in ``wrong`` (where it proposes another token), so rounds accept everything,
    nothing, or a prefix. It reads its position the way the real drafter does (an array)."""

    def __init__(self, continuation: list[int], start: int, wrong: set[int], vocab: int, layer_types):
        self.continuation, self.start, self.wrong, self.vocab = continuation, start, wrong, vocab
        self.layer_types = layer_types
        self.step, self.position = 0, None

    def __call__(self, inputs_embeds, kv, position):
        p = int(position.item())
        self.step = self.step + 1 if p == self.position else 0
        self.position = p
        index = p + 1 + self.step - self.start  # which generated token this draft is
        token = self.continuation[index] if index < len(self.continuation) else 0
        if index in self.wrong:
            token = (token + 1) % self.vocab
        logits = mx.full((1, 1, self.vocab), -10.0).at[0, 0, token].add(20.0)
        return logits, inputs_embeds[..., : inputs_embeds.shape[-1] // 2]


def test_greedy_tokens_equal_plain_decoding(family, e2b_drafter):
    """A random drafter (nothing accepted: every round rolls back) and one built to agree (whole
    rounds accepted, and prefixes), at K = 1..8, for 40 tokens: the sliding windows (8) wrap many
    times. Every run gives exactly the plain greedy tokens."""
    model = family.model
    prompt = mx.array(PROMPT)
    n = 40
    plain = [t for t, _ in generate_tokens(model, prompt, model.make_cache(), n, make_sampler(0.0))]
    vocab = model.text_config.vocab_size
    layer_types = {"sliding_attention", "full_attention"}
    for k in range(1, 9):
        for wrong in (set(), {3, 4, 9, 17, 18, 19, 30}):
            oracle = Oracle(plain, len(PROMPT), wrong, vocab, layer_types)
            stats = SpeculativeStats()
            spec = [t for t, _ in speculative_tokens(model, oracle, prompt, model.make_cache(1), n, make_sampler(0.0), num_draft_tokens=k, stats=stats)]
            assert spec == plain, (k, wrong)
            assert stats.accepted > 0
            if not wrong:
                assert stats.acceptance_rate == 1.0 and stats.target_steps < n
    if family.name == "e2b":
        _, drafter = e2b_drafter
        stats = SpeculativeStats()
        spec = [t for t, _ in speculative_tokens(model, drafter, prompt, model.make_cache(1), n, make_sampler(0.0), num_draft_tokens=3, stats=stats)]
        assert spec == plain


def test_acceptance_rule_keeps_the_target_distribution():
    """The first token a round emits (a kept draft, or the draw after a rejection) is distributed as
    the target's p, whatever the drafter's q. 20000 rounds on 5 tokens, chi-square at p = 1e-4
    (a correct rule fails one run in 10000; seeded, so this one is fixed)."""
    from scipy.stats import chisquare

    mx.random.seed(7)
    p = mx.log(mx.array([[0.5, 0.2, 0.15, 0.1, 0.05], [0.2, 0.2, 0.2, 0.2, 0.2]]))
    q = mx.log(mx.array([[0.05, 0.1, 0.15, 0.2, 0.5]]))
    identity = lambda logprobs: logprobs  # noqa: E731 (the distributions are already final)
    rounds = 20000
    drafts = mx.random.categorical(mx.broadcast_to(q, (rounds, 5)))
    counts = np.zeros(5)
    for i in range(rounds):
        d = drafts[i : i + 1]
        accepted, choice = _accept([d], [q], [p[:1], p[1:]], identity)
        first = d.item() if accepted.item() else choice[0].item()
        counts[first] += 1
    assert chisquare(counts, np.array([0.5, 0.2, 0.15, 0.1, 0.05]) * rounds).pvalue > 1e-4


def test_a_drafter_for_another_model_is_refused(family, tmp_path):
    """Width, vocabulary and K/V shapes are checked, and the message names both models."""
    hf = build_hf_assistant("e2b", hidden_size=48)
    hf.config.backbone_hidden_size = 32
    hf.pre_projection = torch.nn.Linear(64, 48, bias=False)
    hf.post_projection = torch.nn.Linear(48, 32, bias=False)
    hf.save_pretrained(tmp_path)
    drafter = load_drafter(tmp_path)
    with pytest.raises(gemma4_mlx.DrafterMismatchError, match="hidden size of 32, the target has 64"):
        drafter.check_target(family.model.text_config)
    # A model where its assistant was meant: the folder is named.
    with pytest.raises(gemma4_mlx.UnsupportedModelError, match=f"{family.path}.*not a Gemma 4 assistant"):
        load_drafter(family.path)


def test_stream_generate_with_a_draft_model(e2b, e2b_drafter, tmp_path):
    """The public entry points: a drafter folder or a loaded drafter gives the text greedy decoding
    gives alone, with acceptance statistics on the chunks; bad combinations fail with the option's name."""
    hf, drafter = e2b_drafter
    hf.save_pretrained(tmp_path)
    messages = [{"role": "user", "content": "Hello there"}]
    plain = gemma4_mlx.generate(e2b.model, e2b.processor, messages, max_tokens=24)
    assert gemma4_mlx.generate(e2b.model, e2b.processor, messages, max_tokens=24, draft_model=str(tmp_path), num_draft_tokens=3) == plain
    chunks = list(gemma4_mlx.stream_generate(e2b.model, e2b.processor, messages, max_tokens=24, draft_model=drafter))
    assert "".join(c.text for c in chunks) == plain
    last = chunks[-1]
    assert last.draft is not None and last.draft.target_steps >= 1 and last.draft.drafted >= last.draft.accepted
    assert "tokens per target step" in last.summary()
    with pytest.raises(gemma4_mlx.OptionError, match="num_draft_tokens"):
        gemma4_mlx.generate(e2b.model, e2b.processor, messages, draft_model=drafter, num_draft_tokens=0)
    with pytest.raises(gemma4_mlx.OptionError, match="custom sampler"):
        gemma4_mlx.generate(e2b.model, e2b.processor, messages, draft_model=drafter, sampler=lambda x: mx.argmax(x, -1))


def test_command_line_draft_model(e2b, e2b_drafter, tmp_path):
    import subprocess
    import sys

    hf, _ = e2b_drafter
    hf.save_pretrained(tmp_path / "drafter")
    base = [sys.executable, "-m", "gemma4_mlx", "--model", str(e2b.path), "--prompt", "Hi", "--max-tokens", "12"]
    plain = subprocess.run(base, capture_output=True, text=True, check=True)
    spec = subprocess.run(base + ["--draft-model", str(tmp_path / "drafter"), "--num-draft-tokens", "2"], capture_output=True, text=True, check=True)
    assert spec.stdout == plain.stdout
    assert "tokens per target step" in spec.stderr


def test_chat_with_a_draft_model_reuses_prefixes_and_matches_plain_chat(e2b, e2b_drafter):
    """Three turns (the second regenerated) with and without the drafter give the same replies; the
    cache is reused across turns; a reply stopped in the middle of an accepted round leaves the
    cache holding only what was shown, so the next turn still matches."""
    _, drafter = e2b_drafter
    turns = ["Hello there", "Tell me more", "And then?"]

    def converse(chat):
        replies = [chat.ask(turns[0], max_tokens=12)]
        replies.append("".join(c.text for c in chat.regenerate(max_tokens=12) if c.part == "answer"))
        for text in turns[1:]:
            replies.append(chat.ask(text, max_tokens=12))
        return replies, chat.last_stats

    plain, _ = converse(gemma4_mlx.Chat(e2b.model, e2b.processor))
    spec_chat = gemma4_mlx.Chat(e2b.model, e2b.processor, draft_model=drafter, num_draft_tokens=3)
    spec, stats = converse(spec_chat)
    assert spec == plain
    assert stats.reused_tokens > 0 and stats.draft is not None and stats.draft.target_steps > 0
    off = gemma4_mlx.Chat(e2b.model, e2b.processor, draft_model=drafter)
    assert off.ask(turns[0], max_tokens=12, speculative=False) == plain[0] and off.last_stats.draft is None


def test_stopping_inside_a_round_leaves_only_the_shown_tokens_in_the_cache(e2b):
    """An oracle drafter makes whole rounds accepted; closing the stream after the first token of a
    round cuts the cache back to the tokens the caller saw."""
    model = e2b.model
    prompt = mx.array(PROMPT)
    plain = [t for t, _ in generate_tokens(model, prompt, model.make_cache(), 20, make_sampler(0.0))]
    oracle = Oracle(plain, len(PROMPT), set(), model.text_config.vocab_size, {"sliding_attention", "full_attention"})
    cache = model.make_cache(1)
    tokens = speculative_tokens(model, oracle, prompt, cache, 20, make_sampler(0.0), num_draft_tokens=4)
    seen = [next(tokens)[0], next(tokens)[0]]  # the first token, then the first of a 5-token round
    tokens.close()
    assert seen == plain[:2]
    # The plain loop's invariant: the cache holds the prompt and every token shown (the last included).
    assert cache[0].offset == len(PROMPT) + 2


@pytest.mark.parametrize("quantize", [False, True])
def test_converted_drafters_load_and_draft(e2b, tmp_path, quantize):
    """python -m convert learns assistants: a bf16 or 4-bit folder loads, fits the target, and
    greedy speculative decoding with it still gives the plain tokens."""
    from convert import convert

    hf = build_hf_assistant("e2b", ordered=True, hidden_size=64)  # widths a multiple of the group size
    hf.save_pretrained(tmp_path / "src")
    out = convert(str(tmp_path / "src"), tmp_path / "mlx", dtype="bfloat16", quantize=quantize, q_group_size=32, progress=lambda _: None)
    drafter = load_drafter(out)
    if quantize:
        assert drafter.model.layers[0].self_attn.q_proj.bits == 4 and "scales" in drafter.model.embed_tokens
    drafter.check_target(e2b.model.text_config)
    messages = [{"role": "user", "content": "Hello there"}]
    plain = gemma4_mlx.generate(e2b.model, e2b.processor, messages, max_tokens=16)
    assert gemma4_mlx.generate(e2b.model, e2b.processor, messages, max_tokens=16, draft_model=drafter) == plain


def test_speculative_bench_prints_both_bounds(capsys):
    """``python -m gemma4_mlx.bench --speculative`` end to end on small shapes: the agreeing drafter
    keeps every draft (K + 1 tokens per target step), the random one next to none."""
    from gemma4_mlx.bench import speculative as bench

    rows = bench.main(["--variants", "e2b", "--narrow", "--vocab", "2048", "--prompt-tokens", "16", "--gen-tokens", "10", "--draft-tokens", "3"])
    out = capsys.readouterr().out
    assert "agreeing drafter" in out and "| e2b | 10 | 3 |" in out
    (row,) = rows
    assert row["agreeing"][1].acceptance_rate == 1.0
    assert row["random"][1].acceptance_rate < 0.5


def test_app_finds_the_models_own_drafter(e2b, e2b_drafter, tmp_path):
    """The app drafts with ``<folder>-assistant`` beside a local model when there is one (the
    status says so), the same replies as without it; ``draft=False`` and a per-reply switch turn
    it off; a drafter for another model is reported and left out."""
    import shutil

    from app.backend import ModelHolder

    hf, _ = e2b_drafter
    shutil.copytree(e2b.path, tmp_path / "model")
    hf.save_pretrained(tmp_path / "model-assistant")
    holder = ModelHolder(str(tmp_path / "model"), None).start()
    plain = ModelHolder(str(tmp_path / "model"), None, draft=False).start()
    holder.ready.wait(120)
    plain.ready.wait(120)
    assert holder.engine.drafter is not None and "drafting with" in holder.status
    assert plain.engine.drafter is None
    messages = [{"role": "user", "content": "Hello there"}]

    def reply(h, **options):
        return [c for c in h.engine.stream(messages, max_tokens=10, temperature=0.0, **options)][-1]

    drafted, expected = reply(holder), reply(plain)
    assert drafted.reply.content == expected.reply.content and drafted.stats.draft.target_steps > 0
    assert reply(holder, speculative=False).stats.draft is None

    other = build_hf_assistant("dense31b")
    other.save_pretrained(tmp_path / "other")
    mismatched = ModelHolder(str(tmp_path / "model"), None, draft=str(tmp_path / "other")).start()
    mismatched.ready.wait(120)
    assert mismatched.engine is not None and mismatched.engine.drafter is None and "no drafter" in mismatched.status


def test_sampling_with_a_drafter_keeps_the_models_distribution():
    """End to end on a 4-token vocabulary (a random target and a random drafter, which disagree
    often): over 2000 seeded runs each, the (first, second) token pairs generated with the drafter
    and without it come from the same distribution (chi-square contingency test, fails one correct
    run in 10000)."""
    from scipy.stats import chi2_contingency

    from gemma4_mlx.config import ModelConfig, TextConfig
    from gemma4_mlx.generation.options import GenerationOptions
    from gemma4_mlx.models.assistant import Assistant, AssistantConfig
    from gemma4_mlx.models.gemma4 import Gemma4Model

    text = dict(vocab_size=4, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                head_dim=16, global_head_dim=16, layer_types=["sliding_attention", "full_attention"], sliding_window=4,
                hidden_size_per_layer_input=0, final_logit_softcapping=30.0)  # fmt: skip
    mx.random.seed(0)
    model = Gemma4Model(ModelConfig.from_dict({"model_type": "gemma4_text", **text}))
    drafter = Assistant(AssistantConfig(TextConfig.from_dict({**text, "hidden_size": 16, "intermediate_size": 16}), backbone_hidden_size=32))
    # Sharper logits than MLX's default initialisation gives, so p and q differ a lot.
    drafter.model.embed_tokens.weight = drafter.model.embed_tokens.weight * 8
    model.language_model.embed_tokens.weight = model.language_model.embed_tokens.weight * 8
    mx.eval(model.parameters(), drafter.parameters())
    opts = GenerationOptions(temperature=1.0)
    prompt = mx.array([1, 2, 3])
    counts = np.zeros((2, 16))
    for run in range(2000):
        for row, use_drafter in enumerate((False, True)):
            mx.random.seed(run * 2 + row)
            if use_drafter:
                # 3 tokens: the first from the prompt, then one round drafting 1 (k = 1) and its check.
                tokens = speculative_tokens(model, drafter, prompt, model.make_cache(1), 3, opts.make_sampler(), distribution=opts.make_distribution(), num_draft_tokens=1)
            else:
                tokens = generate_tokens(model, prompt, model.make_cache(), 3, opts.make_sampler())
            a, b, _ = (t for t, _ in tokens)
            counts[row, a * 4 + b] += 1
    seen = counts.sum(axis=0) > 0
    assert chi2_contingency(counts[:, seen]).pvalue > 1e-4


def test_the_sampling_distribution_is_what_the_sampler_draws_from():
    """GenerationOptions.make_distribution (what acceptance compares) against mlx-lm's sampler with
    the same temperature, top-p, min-p and top-k: 20000 draws on 6 tokens, chi-square at 1e-4;
    filtered-out tokens are never drawn and have probability 0."""
    from scipy.stats import chisquare

    from gemma4_mlx.generation.options import GenerationOptions

    logprobs = mx.log(mx.array([[0.35, 0.25, 0.2, 0.1, 0.06, 0.04]]))
    for opts in (GenerationOptions(temperature=0.7, top_k=4), GenerationOptions(temperature=1.3, top_p=0.8),
                 GenerationOptions(temperature=1.0, min_p=0.2, top_k=5)):  # fmt: skip
        mx.random.seed(3)
        p = np.array(mx.exp(opts.make_distribution()(logprobs)))[0].astype(np.float64)
        draws = np.array(opts.make_sampler()(mx.broadcast_to(logprobs, (20000, 6))))
        counts = np.bincount(draws, minlength=6)
        assert np.all(counts[p == 0] == 0) and abs(p.sum() - 1) < 1e-5
        kept = p > 0
        expected = p[kept] / p[kept].sum() * counts[kept].sum()
        assert chisquare(counts[kept], expected).pvalue > 1e-4, opts


def test_greedy_with_a_repetition_penalty_equals_plain(e2b):
    """Logits processors see, at each verified position, the context the plain loop would give them
    (the drafted tokens before it): with an agreeing drafter and a repetition penalty, the same tokens."""
    from mlx_lm.sample_utils import make_logits_processors

    model = e2b.model
    prompt = mx.array(PROMPT)
    processors = make_logits_processors(repetition_penalty=1.8, repetition_context_size=6)
    plain = [t for t, _ in generate_tokens(model, prompt, model.make_cache(), 30, make_sampler(0.0), processors)]
    oracle = Oracle(plain, len(PROMPT), {5, 11}, model.text_config.vocab_size, {"sliding_attention", "full_attention"})
    stats = SpeculativeStats()
    spec = [t for t, _ in speculative_tokens(model, oracle, prompt, model.make_cache(1), 30, make_sampler(0.0), processors, num_draft_tokens=4, stats=stats)]
    assert spec == plain and stats.accepted > 10
