"""Generation: chat prompts, chunks and stats, stopping, sampling, streaming UTF-8 and the command line.

Runs on the tiny e2b checkpoint of ``conftest.py`` (random weights, the tiny Gemma-4-style tokenizer
with the published special-token ids and the published chat template). Where the test needs the
model to say something specific, a logits processor forces it.
"""

import codecs
import json
import re
import shutil
import subprocess
import sys
import time

import mlx.core as mx
import pytest

from gemma4_mlx import GenerationChunk, Processor, generate, stream_generate

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "hello world"},
]
END_OF_TURN, EOS = 106, 1
EMPTY_THOUGHT = "<|channel>thought\n<channel|>"


class Recorder:
    """A logits processor that records the token history it is shown (prompt + generated so far)."""

    def __init__(self):
        self.histories = []

    def __call__(self, tokens, logits):
        self.histories.append(tokens.tolist())
        return logits


def forcing(script):
    """A logits processor that makes ``script[k]`` the only likely token at generation step k."""
    state = {}

    def proc(tokens, logits):
        step = tokens.size - state.setdefault("prompt", tokens.size)
        if step < len(script):
            onehot = mx.arange(logits.shape[-1]) == script[step]
            logits = mx.where(onehot, 1e4, -1e4).astype(logits.dtype) * mx.ones_like(logits)
        return logits

    return proc


def no_stop(tokens, logits):
    """Never pick an end token (so runs last exactly max_tokens)."""
    return logits.at[:, mx.array([EOS, END_OF_TURN])].add(-1e9)


@pytest.fixture(scope="module")
def e2b_pair(e2b):
    """(model, processor) of the text-only e2b family."""
    return e2b.model, e2b.processor


def tokens_of(chunks):
    return [c.token for c in chunks]


# --------------------------------------------------------------------------- prompts and chunks
@pytest.mark.parametrize("thinking", [False, True])
def test_chat_messages_go_through_the_chat_template(e2b_pair, thinking):
    model, processor = e2b_pair
    rec = Recorder()
    list(stream_generate(model, processor, MESSAGES, max_tokens=2, enable_thinking=thinking, logits_processors=[rec]))
    prompt = rec.histories[0]
    expected = processor.apply_chat_template(MESSAGES, tokenize=True, enable_thinking=thinking)
    assert prompt == expected
    text = processor.decode(prompt)
    assert text == processor.apply_chat_template(MESSAGES, enable_thinking=thinking)
    # The template writes <bos> itself: exactly one, at the start.
    assert prompt[0] == 2 and prompt.count(2) == 1
    assert "<|turn>user\nhello world<turn|>\n" in text
    assert text.endswith("<|turn>model\n" + ("" if thinking else EMPTY_THOUGHT))


def test_enable_thinking_changes_the_prompt(e2b_pair):
    model, processor = e2b_pair
    prompts = {}
    for thinking in (False, True):
        rec = Recorder()
        list(stream_generate(model, processor, MESSAGES, max_tokens=1, enable_thinking=thinking, logits_processors=[rec]))
        prompts[thinking] = processor.decode(rec.histories[0])
    assert prompts[False] != prompts[True]
    assert prompts[False].endswith(EMPTY_THOUGHT) and EMPTY_THOUGHT not in prompts[True]
    assert "<|think|>" in prompts[True] and "<|think|>" not in prompts[False]


def test_raw_string_and_id_prompts(e2b_pair):
    model, processor = e2b_pair
    rec = Recorder()
    list(stream_generate(model, processor, "hello world", max_tokens=1, logits_processors=[rec]))
    assert rec.histories[0] == [2] + processor.encode("hello world", add_special_tokens=False)
    rec = Recorder()
    ids = [2, 300, 301, 302]
    list(stream_generate(model, processor, ids, max_tokens=1, logits_processors=[rec]))
    assert rec.histories[0] == ids


def test_chunks_carry_text_token_and_stats(e2b_pair):
    model, processor = e2b_pair
    n = 6
    tic = time.perf_counter()
    chunks = list(stream_generate(model, processor, MESSAGES, max_tokens=n, logits_processors=[no_stop]))
    elapsed = time.perf_counter() - tic
    prompt_len = len(processor.apply_chat_template(MESSAGES, tokenize=True))
    assert len(chunks) == n
    for i, c in enumerate(chunks, start=1):
        assert isinstance(c, GenerationChunk)
        assert isinstance(c.text, str)
        assert isinstance(c.token, int) and 0 <= c.token < model.text_config.vocab_size
        assert c.prompt_tokens == prompt_len
        assert c.generation_tokens == i
        # The prompt was prefilled and the tokens generated within the call: rates cannot be lower
        # than the counts over the whole call's time (a wrong unit or an inverted ratio would be).
        assert c.prompt_tps >= prompt_len / elapsed
        assert c.generation_tps >= (i - 1) / elapsed
        assert 0 < c.peak_memory < 64  # GB: a byte count would be far larger
        assert c.finish_reason == (None if i < n else "length")
    assert chunks[0].generation_tps == 0.0 and chunks[-1].generation_tps >= (n - 1) / elapsed


def test_generate_returns_the_concatenated_chunks(e2b_pair):
    model, processor = e2b_pair
    chunks = list(stream_generate(model, processor, MESSAGES, max_tokens=12))
    assert len(chunks) >= 1
    text = generate(model, processor, MESSAGES, max_tokens=12)
    assert isinstance(text, str)
    assert text == "".join(c.text for c in chunks)


# --------------------------------------------------------------------------- stopping
@pytest.mark.parametrize("end", [END_OF_TURN, EOS])
@pytest.mark.parametrize("at_step", [0, 2])
def test_end_token_stops_without_its_text(e2b_pair, end, at_step):
    model, processor = e2b_pair
    assert end in processor.eos_token_ids
    words = processor.encode(" hello world the", add_special_tokens=False)[:at_step]
    script = words + [end]
    chunks = list(stream_generate(model, processor, MESSAGES, max_tokens=20, logits_processors=[forcing(script)]))
    assert tokens_of(chunks) == script
    assert [c.finish_reason for c in chunks] == [None] * at_step + ["stop"]
    out = "".join(c.text for c in chunks)
    assert out == processor.decode(words)
    assert "<turn|>" not in out and "<eos>" not in out
    text = generate(model, processor, MESSAGES, max_tokens=20, logits_processors=[forcing(script)])
    assert text == out


def test_generation_config_eos_ids_stop_too(e2b, tmp_path):
    """Published checkpoints list extra stop ids ([1, 106, 50]) in generation_config.json."""
    folder = tmp_path / "ckpt"
    shutil.copytree(e2b.path, folder)
    gen = json.loads((folder / "generation_config.json").read_text())
    gen["eos_token_id"] = [1, 106, 50]
    (folder / "generation_config.json").write_text(json.dumps(gen))
    processor = Processor.from_pretrained(folder)
    assert processor.eos_token_ids == {1, 106, 50}
    assert 50 not in e2b.processor.eos_token_ids
    script = [300, 50, 301]
    chunks = list(stream_generate(e2b.model, processor, "hi", max_tokens=10, logits_processors=[forcing(script)]))
    assert tokens_of(chunks) == [300, 50] and chunks[-1].finish_reason == "stop"
    # The original processor does not stop there.
    chunks = list(stream_generate(e2b.model, e2b.processor, "hi", max_tokens=3, logits_processors=[forcing(script)]))
    assert tokens_of(chunks) == script and chunks[-1].finish_reason == "length"


# --------------------------------------------------------------------------- sampling
SAMPLE = dict(max_tokens=24, temperature=2.0, logits_processors=[no_stop])


def test_same_seed_same_tokens_different_seed_different_tokens(e2b_pair):
    model, processor = e2b_pair
    a = tokens_of(stream_generate(model, processor, "hello", seed=11, **SAMPLE))
    b = tokens_of(stream_generate(model, processor, "hello", seed=11, **SAMPLE))
    c = tokens_of(stream_generate(model, processor, "hello", seed=12, **SAMPLE))
    greedy = tokens_of(stream_generate(model, processor, "hello", max_tokens=24, logits_processors=[no_stop]))
    assert len(a) == len(c) == 24
    assert a == b
    assert a != c
    assert a != greedy


@pytest.mark.parametrize("option", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_truncating_samplers_down_to_one_token_equal_greedy(e2b_pair, option):
    model, processor = e2b_pair
    greedy = tokens_of(stream_generate(model, processor, MESSAGES, max_tokens=16, logits_processors=[no_stop]))
    sampled = tokens_of(stream_generate(model, processor, MESSAGES, seed=3, **dict(SAMPLE, max_tokens=16), **option))
    assert sampled == greedy


def _repeats_within(tokens, prompt, window):
    """Generated tokens that already occur in the ``window`` tokens before them."""
    history = list(prompt)
    out = []
    for t in tokens:
        if t in history[-window:]:
            out.append(t)
        history.append(t)
    return out


def test_repetition_penalty_stops_greedy_repeats(e2b_pair):
    model, processor = e2b_pair
    prompt = [2] + processor.encode("hello world", add_special_tokens=False)
    greedy = tokens_of(stream_generate(model, processor, prompt, max_tokens=24, logits_processors=[no_stop]))
    assert _repeats_within(greedy, prompt, 64), "precondition: the tiny model repeats itself when greedy"
    rec = Recorder()
    penalised = tokens_of(
        stream_generate(
            model, processor, prompt, max_tokens=24, repetition_penalty=1e4, repetition_context_size=64,
            logits_processors=[rec, no_stop],
        )
    )
    assert len(penalised) == 24
    assert penalised != greedy
    # With a huge penalty over the whole history, nothing seen before can win again.
    assert _repeats_within(penalised, prompt, 64) == []
    # Custom logits processors run alongside the penalty and see the whole history.
    assert rec.histories[-1] == prompt + penalised[:-1]
    # A mild penalty changes a repeating greedy run too.
    mild = tokens_of(stream_generate(model, processor, prompt, max_tokens=24, repetition_penalty=1.5))
    assert mild != greedy[: len(mild)]


# --------------------------------------------------------------------------- streaming detokenizer
@pytest.mark.parametrize("text", ["日本 ✓", "café 😀 ok", " spaced ünïcödé"])
def test_streaming_never_emits_broken_utf8(e2b_pair, text):
    model, processor = e2b_pair
    ids = processor.encode(text, add_special_tokens=False)
    assert any(processor.tokenizer.convert_ids_to_tokens(i).startswith("<0x") for i in ids), "byte-fallback tokens expected"
    chunks = list(stream_generate(model, processor, "hi", max_tokens=len(ids) + 5, logits_processors=[forcing(ids + [END_OF_TURN])]))
    assert tokens_of(chunks) == ids + [END_OF_TURN]
    # The reference: the tokens' bytes through an incremental UTF-8 decoder, which emits every
    # character as soon as its last byte arrives and nothing before.
    utf8 = codecs.getincrementaldecoder("utf-8")()
    for tok, c in zip(processor.tokenizer.convert_ids_to_tokens(ids), chunks):
        assert isinstance(c.text, str) and "\ufffd" not in c.text
        c.text.encode("utf-8")  # no lone surrogates
        piece = bytes([int(tok[3:5], 16)]) if tok.startswith("<0x") else tok.replace("\u2581", " ").encode()
        assert c.text == utf8.decode(piece)
    assert "".join(c.text for c in chunks) == text == processor.decode(ids)
    # Some characters really were split across tokens (else the test shows nothing).
    assert any(c.text == "" for c in chunks[:-1])


# --------------------------------------------------------------------------- command line
def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "gemma4_mlx", *args], capture_output=True, text=True, timeout=180
    )


def test_command_line_generates_and_reports_stats(e2b):
    r = _cli("--model", str(e2b.path), "--prompt", "hello", "--max-tokens", "5")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    m = re.search(
        r"^prompt: (\d+) tokens, [\d.]+ tok/s \| generation: (\d+) tokens, [\d.]+ tok/s \| "
        r"peak memory [\d.]+ GB \| finish: (length|stop)$",
        r.stderr,
        re.M,
    )
    assert m, r.stderr
    prompt_tokens = len(e2b.processor.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=True))
    assert int(m.group(1)) == prompt_tokens
    n = int(m.group(2))
    assert 1 <= n <= 5 and (m.group(3) == "stop" or n == 5)
    # Greedy: the command line prints what the library generates.
    expected = generate(e2b.model, e2b.processor, [{"role": "user", "content": "hello"}], max_tokens=5)
    assert r.stdout == expected + "\n"


def test_command_line_missing_model_is_a_one_line_error(tmp_path):
    missing = tmp_path / "no-such-model"
    r = _cli("--model", str(missing), "--prompt", "hello")
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ") and str(missing) in lines[0]
    assert r.stdout == ""


# --------------------------------------------------------------------------- bad options
BAD_OPTIONS = [
    (dict(temperature=-0.5), r"temperature must be a number >= 0, not -0.5"),
    (dict(temperature=float("nan")), r"temperature must be a number >= 0, not nan"),
    (dict(top_p=0.0), r"top_p must be a number in \(0, 1\], not 0.0"),
    (dict(top_p=1.5), r"top_p must be a number in \(0, 1\], not 1.5"),
    (dict(top_k=-1), r"top_k must be an integer >= 0, not -1"),
    (dict(min_p=2.0), r"min_p must be a number in \[0, 1\], not 2.0"),
    (dict(max_tokens=None), r"max_tokens must be an integer >= 1, not None"),
    (dict(max_tokens=0), r"max_tokens must be an integer >= 1, not 0"),
    (dict(prefill_step_size=0), r"prefill_step_size must be an integer >= 1, not 0"),
    (dict(repetition_penalty=0.0), r"repetition_penalty must be a number > 0 or None, not 0.0"),
    (dict(seed=-1), r"seed must be an integer from 0 to 18446744073709551615 or None, not -1"),
    (dict(seed=2**64), r"seed must be an integer .* not 18446744073709551616"),
    (dict(max_soft_tokens=100), r"max_soft_tokens \(the image token budget\) must be one of"),
]


@pytest.mark.parametrize("option, message", BAD_OPTIONS, ids=[next(iter(o)) + "=" + repr(next(iter(o.values()))) for o, _ in BAD_OPTIONS])
def test_bad_options_are_refused_at_every_entry_point(e2b_pair, option, message):
    from gemma4_mlx import Chat, ChatEngine, OptionError

    model, processor = e2b_pair
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(OptionError, match=message):
        next(stream_generate(model, processor, messages, **option))
    with pytest.raises(OptionError, match=message):
        next(ChatEngine(model, processor).stream(messages, **option))
    with pytest.raises(OptionError, match=message):
        Chat(model, processor, **option)


@pytest.mark.parametrize(
    "args, stdin, message",
    [
        (["--prompt", "-"], b"caf\xe9 au lait", "standard input is not UTF-8 text (byte 3 of 12)"),
        (["--prompt", "hi", "--seed", "-1"], b"", "seed must be an integer from 0 to"),
        (["--prompt", "hi", "--top-p", "0"], b"", "top_p must be a number in (0, 1]"),
        (["--prompt", "hi", "--image-tokens", "99"], b"", "max_soft_tokens (the image token budget) must be one of"),
    ],
)
def test_command_line_bad_input_is_a_one_line_error(e2b, args, stdin, message, monkeypatch, capsys):
    import io

    from gemma4_mlx.cli import main

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
    assert main(["--model", str(e2b.path), *args]) == 1  # returned, not raised: no traceback
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"error: {err.strip()[7:]}"] and message in err
