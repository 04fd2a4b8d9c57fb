"""A tiny Gemma-4-style tokenizer, built locally for tests, benchmarks and the demo mode.

Real Gemma 4 tokenizers come with the checkpoints (262144 tokens, SentencePiece-style BPE with byte
fallback). Where no checkpoint can be downloaded we build a small tokenizer of the same kind with
the `tokenizers` library: the same special tokens at the published ids (pad 0, eos 1, bos 2,
``<|turn>`` 105, ``<turn|>`` 106, ...), byte fallback for any text, and the same decoder, so the
chat template, the stop tokens and the streaming detokenizer behave as with a real checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from .processing.processor import published_chat_template

# Special tokens at the ids the published Gemma 4 vocabulary uses.
SPECIAL_TOKENS = {
    0: "<pad>",
    1: "<eos>",
    2: "<bos>",
    3: "<unk>",
    4: "<mask>",
    46: "<|tool>",
    47: "<tool|>",
    48: "<|tool_call>",
    49: "<tool_call|>",
    50: "<|tool_response>",
    51: "<tool_response|>",
    52: '<|"|>',
    98: "<|think|>",
    100: "<|channel>",
    101: "<channel|>",
    105: "<|turn>",
    106: "<turn|>",
}
RESERVED = 112  # ids below this are special (unused ones become <unused{i}>)

# Multimodal markers; their ids are written into the tiny model's config.json.
MEDIA_TOKENS = ["<|image>", "<image|>", "<|image|>", "<|audio>", "<audio|>", "<|audio|>", "<|video|>"]

_WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who oil its now find long down day did "
    "get come made may part hello world model user gemma think answer question tool image audio video"
).split()


def build_tokenizer_object(vocab_size: int | None = None):
    """A `tokenizers.Tokenizer`: specials, 256 byte tokens, ASCII characters and common words,
    padded with unused tokens up to ``vocab_size`` (the model's embedding rows)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    vocab: dict[str, int] = {}
    for i in range(RESERVED):
        vocab[SPECIAL_TOKENS.get(i, f"<unused{i}>")] = i
    for tok in MEDIA_TOKENS:
        vocab[tok] = len(vocab)
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for c in ["\u2581"] + [chr(c) for c in range(33, 127)] + ["\n"]:
        vocab.setdefault(c, len(vocab))
    merges: list[tuple[str, str]] = []
    for word in _WORDS:
        piece = "\u2581"
        for ch in word:
            merged = piece + ch
            if merged not in vocab:
                vocab[merged] = len(vocab)
                merges.append((piece, ch))
            piece = merged
    if vocab_size is not None:
        if vocab_size < len(vocab):
            raise ValueError(f"the tiny tokenizer needs a vocabulary of at least {len(vocab)} tokens")
        for i in range(len(vocab), vocab_size):
            vocab[f"<unused{i}>"] = i

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", 2)])
    specials = list(SPECIAL_TOKENS.values()) + MEDIA_TOKENS
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return tok


def write_tokenizer(folder: str | Path, chat_template: str | None = None, vocab_size: int | None = None) -> int:
    """Write tokenizer files (and the chat template) into ``folder``; returns the vocabulary size."""
    from transformers import PreTrainedTokenizerFast

    tok = build_tokenizer_object(vocab_size)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        pad_token="<pad>",
        mask_token="<mask>",
        add_bos_token=True,
    )
    fast.chat_template = chat_template if chat_template is not None else published_chat_template()
    fast.save_pretrained(str(folder))
    return tok.get_vocab_size()


def media_token_ids() -> dict[str, int]:
    """Config fields for the multimodal markers of the tiny tokenizer."""
    base = RESERVED
    names = ["boi_token_id", "eoi_token_id", "image_token_id", "boa_token_id", "eoa_token_index", "audio_token_id", "video_token_id"]
    return {name: base + i for i, name in enumerate(names)}


# A small E2B-shaped model (per-layer embeddings, KV sharing, 4:1 sliding/full pattern) with tiny
# vision and audio towers: big enough to exercise every code path of the app, small enough to build
# in a second on a CPU.
DEMO_TEXT = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=5, layer_types=["sliding_attention"] * 4 + ["full_attention"],
    num_attention_heads=4, num_key_value_heads=1, head_dim=32, global_head_dim=64, sliding_window=64,
    hidden_size_per_layer_input=16, num_kv_shared_layers=0, use_double_wide_mlp=False, final_logit_softcapping=30.0,
    max_position_embeddings=8192, rms_norm_eps=1e-6, pad_token_id=0, bos_token_id=2, eos_token_id=1,
)  # fmt: skip
DEMO_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                   head_dim=16, position_embedding_size=256)  # fmt: skip
DEMO_AUDIO = dict(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, subsampling_conv_channels=[128, 4], output_proj_dims=32)


def build_demo_checkpoint(folder: str | Path, seed: int = 0) -> Path:
    """Write a tiny random Gemma 4 checkpoint (text, vision, audio) with the tiny tokenizer.

    It needs no download and no PyTorch: the weights come from our own modules' random init. Its
    replies are gibberish; it exists so the app and scripts can be tried and tested anywhere.
    """
    import json

    import mlx.core as mx
    from mlx.utils import tree_flatten

    from .config import ModelConfig
    from .models.gemma4 import Gemma4Model

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(folder, chat_template=published_chat_template(small=True))  # E2B-shaped
    text = {**DEMO_TEXT, "vocab_size": vocab, "vocab_size_per_layer_input": vocab}
    raw = {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"], "text_config": text,
           "vision_config": DEMO_VISION, "audio_config": DEMO_AUDIO, "eos_token_id": [1, 106], **media_token_ids()}  # fmt: skip
    mx.random.seed(seed)
    model = Gemma4Model(ModelConfig.from_dict(raw))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    return folder
