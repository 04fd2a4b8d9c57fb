"""The processor: tokenizer, chat template, stop tokens, and the image/audio/video processors.

The tokenizer is loaded from the checkpoint's own files with transformers (``AutoTokenizer``) and
wrapped by mlx-lm's ``TokenizerWrapper``, which picks the right streaming detokenizer. Like HF's
``Gemma4Processor``, ``processor(text=..., images=..., audio=..., videos=...)`` expands each
placeholder (``<|image|>``, ``<|audio|>``, ``<|video|>``) into begin/end markers around one token per
soft token, and returns arrays that ``model(**inputs)`` accepts.
"""

from __future__ import annotations

import contextlib
import re
from importlib import resources
from pathlib import Path
from typing import Any, Iterable

import mlx.core as mx
import numpy as np
from transformers.utils.chat_template_utils import _CONTROL_TOKEN_START, encode_marked_chat, mark_control_tokens

from ..config import ModelConfig, read_json_object
from ..errors import ConfigError, MediaError, TokenIdError
from ..modalities import MODALITIES
from .sources import resolve_source

END_OF_TURN = "<turn|>"
# transformers marks control tokens found in user text as START + token + END (``mark_control_tokens``);
# a placeholder preceded by START is user text, not a media slot.
_UNMARKED = f"(?<!{_CONTROL_TOKEN_START})"
# Our own private-use mark, around the number of a reply whose generated ids stand in for its text.
REPLY_MARK = "\U000f0002"
_REPLY_RE = re.compile(f"{REPLY_MARK}(\\d+){REPLY_MARK}")


class Processor:
    """Turns prompts or chat messages into token ids, and token ids back into text."""

    def __init__(self, tokenizer, config: ModelConfig, eos_token_ids: Iterable[int], image_processor=None, audio_extractor=None,
                 video_processor=None):
        self.tokenizer = tokenizer  # mlx_lm.tokenizer_utils.TokenizerWrapper
        self.config = config
        self.eos_token_ids = set(eos_token_ids)
        self.tokenizer.eos_token_ids = self.eos_token_ids
        self.image_processor = image_processor  # None for checkpoints without a vision tower
        self.audio_extractor = audio_extractor  # None for checkpoints without an audio tower
        self.video_processor = video_processor  # None for checkpoints without a vision tower
        tok = lambda i: tokenizer.convert_ids_to_tokens(i) if i is not None else None  # noqa: E731
        self.image_token, self.video_token, self.audio_token = (
            tok(config.image_token_id), tok(config.video_token_id), tok(config.audio_token_id)
        )
        self.boi_token, self.eoi_token = tok(config.boi_token_id), tok(config.eoi_token_id)
        self.boa_token, self.eoa_token = tok(config.boa_token_id), tok(config.eoa_token_id)
        self._control_re: re.Pattern | None = None

    @classmethod
    def from_pretrained(cls, model_path: str | Path, config: ModelConfig | None = None) -> "Processor":
        from mlx_lm.tokenizer_utils import load as load_tokenizer

        model_path = Path(model_path)
        if config is None:
            config = ModelConfig.from_file(model_path / "config.json")
        if not any((model_path / f).exists() for f in ("tokenizer.json", "tokenizer.model")):
            raise FileNotFoundError(f"no tokenizer files (tokenizer.json) in {model_path}")
        tokenizer = load_tokenizer(model_path)
        if tokenizer.chat_template is None:
            # Prefer the checkpoint's own template; fall back to the published one of this kind of model.
            # The 12B (no per-layer inputs) gets the 26B/31B one: google/gemma-4-12B-it ships the same
            # template, with the empty thought channel after the generation prompt when thinking is off.
            tokenizer._tokenizer.chat_template = published_chat_template(small=config.text_config.has_per_layer_inputs)
        image_processor = audio_extractor = video_processor = None
        if config.is_unified:  # the 12B, encoder-free: merged 48 px patches and raw audio frames
            from .unified import unified_processors

            image_processor, audio_extractor, video_processor = unified_processors(model_path, config)
        elif config.vision_config:
            from .image import ImageProcessor
            from .video import VideoProcessor
            from ..models.vision import VisionConfig

            image_processor = ImageProcessor.from_pretrained(model_path)
            image_processor.position_table_size = VisionConfig.from_dict(config.vision_config).position_embedding_size
            video_processor = VideoProcessor.from_pretrained(model_path)
        if config.audio_config and not config.is_unified:
            from .audio import AudioFeatureExtractor

            audio_extractor = AudioFeatureExtractor.from_pretrained(model_path)
        eos = _eos_token_ids(model_path, config, tokenizer)
        return cls(tokenizer, config, eos, image_processor, audio_extractor, video_processor)

    # ----------------------------------------------------------------- text <-> ids
    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        enable_thinking: bool = False,
        tokenize: bool = False,
        **kwargs,
    ) -> str | list[int]:
        """Render chat messages with the checkpoint's template (thinking on/off via ``enable_thinking``).

        With ``tokenize=True`` the result is token ids in which text from the messages is plain text
        (see :meth:`render`); the string form shows the prompt as the template writes it."""
        if tokenize:
            return self._encode_chat(*self.render(messages, enable_thinking, add_generation_prompt, **kwargs))
        _check_messages(messages)
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking, tokenize=False, **kwargs
        )

    def render(
        self,
        messages: list[dict[str, Any]],
        enable_thinking: bool = False,
        add_generation_prompt: bool = True,
        replies: dict[str, list[int]] | None = None,
        **kwargs,
    ) -> tuple[str, list[list[int]]]:
        """The chat template's output for ``messages``, marked for :meth:`_encode_chat`.

        Text from the messages and from ``kwargs`` (``tools``, ...) is user text: a control token in it
        (``<turn|>``, ``<|image|>``, ...) must reach the model as the characters typed, not as the
        token. transformers' ``mark_control_tokens`` wraps such tokens in private-use markers before
        rendering, so they can be told apart from the template's own tokens afterwards.

        ``replies`` maps an assistant message's text to the token ids that generated it: such a
        message is rendered as a numbered marker that encodes to those ids, so the conversation
        re-renders exactly to the tokens the KV cache holds (re-tokenizing the text can give other
        ids). Returns the rendered text and the id lists of the markers in it.
        """
        _check_messages(messages)
        marked = mark_control_tokens(_drop_reply_marks(messages), self._control_tokens)
        reply_ids: list[list[int]] = []
        if replies:
            for original, message in zip(messages, marked):
                ids = replies.get(original["content"].strip()) if isinstance(original.get("content"), str) else None
                if original.get("role") == "assistant" and ids is not None:
                    message["content"] = f"{REPLY_MARK}{len(reply_ids)}{REPLY_MARK}"
                    reply_ids.append(list(ids))
        kwargs = mark_control_tokens(_drop_reply_marks(kwargs), self._control_tokens)
        text = self.tokenizer.apply_chat_template(
            marked, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking, tokenize=False, **kwargs
        )
        return text, reply_ids

    def _encode_chat(self, text: str, reply_ids: list[list[int]] = ()) -> list[int]:
        """Token ids of a rendered chat (see :meth:`render`): marked control tokens as plain text (by
        transformers' ``encode_marked_chat``), reply markers as their ids, the rest as usual."""
        hf = self.tokenizer._tokenizer
        parts = _REPLY_RE.split(text)  # [text, number, text, number, ..., text]
        ids = encode_marked_chat(hf, parts[0].replace(REPLY_MARK, ""))
        for number, part in zip(parts[1::2], parts[2::2]):
            ids += reply_ids[int(number)]
            part = part.replace(REPLY_MARK, "")  # a lone mark, if the template split one
            if part:
                # As transformers does for pieces of a chat: encode after a newline, so that a
                # SentencePiece tokenizer adds no prefix space, then remove the newline's ids.
                with_newline = encode_marked_chat(hf, "\n" + part)
                newline = hf.encode("\n", add_special_tokens=False)
                ids += with_newline[len(newline) :] if with_newline[: len(newline)] == newline else encode_marked_chat(hf, part)
        return ids

    @property
    def _control_tokens(self) -> re.Pattern:
        """A regex of the tokenizer's special tokens (longest first), which user text must not produce."""
        if self._control_re is None:
            hf = self.tokenizer._tokenizer
            tokens = sorted((t.content for t in hf.added_tokens_decoder.values() if t.special), key=len, reverse=True)
            self._control_re = re.compile("|".join(map(re.escape, tokens)) or "(?!)")
        return self._control_re

    def prompt_ids(self, prompt: str | list[dict[str, Any]] | list[int], enable_thinking: bool = False, **kwargs) -> list[int]:
        """Token ids for a raw prompt string (encoded as is: control tokens typed in it are tokens),
        a list of chat messages (their text is plain text), or ids given as is."""
        if isinstance(prompt, str):
            return self.encode(prompt)
        if isinstance(prompt, mx.array):
            prompt = prompt.reshape(-1).tolist()
        if isinstance(prompt, (list, tuple)) and prompt and not any(isinstance(m, dict) for m in prompt):
            return check_ids(prompt, self.config.text_config.vocab_size)
        return self.apply_chat_template(prompt, enable_thinking=enable_thinking, tokenize=True, **kwargs)

    def __call__(
        self,
        text: str | list[str] | None = None,
        images=None,
        audio=None,
        videos=None,
        max_soft_tokens: int | None = None,
        add_special_tokens: bool = True,
    ) -> dict[str, Any]:
        """``processor(text=..., images=..., audio=..., videos=...)`` -> inputs for ``model(**inputs)``.

        ``text`` holds one placeholder per media item, in order (``<|image|>``, ``<|audio|>``,
        ``<|video|>``; the chat template writes them); it is encoded as is, control tokens included,
        as transformers' ``Gemma4Processor`` does. ``max_soft_tokens`` is the image token budget
        (70, 140, 280, 560 or 1120; default 280); video frames keep the video processor's (70), where
        transformers' processor hands this budget to its video processor too. Returns ``input_ids``
        [1, L] and, per modality present, ``pixel_values``/``image_position_ids``,
        ``pixel_values_videos``/``video_position_ids``, ``input_features``/``input_features_mask``.
        """
        if text is None:
            raise ValueError("processor needs text")
        if not isinstance(text, str):
            texts = list(text)
            if len(texts) != 1 or images or audio or videos:
                ids = [self.encode(t, add_special_tokens) for t in texts]
                if images or audio or videos or len({len(i) for i in ids}) != 1:
                    raise ValueError("batches need texts of equal token length and no media; pass one text")
                return {"input_ids": mx.array(ids)}
            text = texts[0]
        inputs, expansions = self._process_media(images, audio, videos, max_soft_tokens)
        text = self._expand(text, expansions)
        inputs["input_ids"] = mx.array([self.encode(text, add_special_tokens)])
        return inputs

    def _process_media(self, images, audio, videos, max_soft_tokens: int | None) -> tuple[dict[str, Any], dict[str, list[str]]]:
        """Arrays for the model, and each placeholder's expansions (one per item, in order)."""
        inputs: dict[str, Any] = {}
        expansions: dict[str, list[str]] = {}
        if images is not None:
            self._require(self.image_processor, "image")
            out = self.image_processor(_as_list(images), max_soft_tokens=max_soft_tokens)
            inputs["pixel_values"] = mx.array(out["pixel_values"])
            inputs["image_position_ids"] = mx.array(out["image_position_ids"])
            expansions[self.image_token] = [self.boi_token + self.image_token * n + self.eoi_token for n in out["num_soft_tokens"]]
        if audio is not None:
            self._require(self.audio_extractor, "audio")
            out = self.audio_extractor(_as_list(audio))  # refuses clips too short for one token
            inputs["input_features"] = mx.array(out["input_features"])
            inputs["input_features_mask"] = mx.array(out["input_features_mask"])
            expansions[self.audio_token] = [self.boa_token + self.audio_token * n + self.eoa_token for n in out["num_soft_tokens"]]
        if videos is not None:
            self._require(self.video_processor, "video")
            out = self.video_processor(_as_list(videos))
            inputs["pixel_values_videos"] = mx.array(out["pixel_values_videos"])
            inputs["video_position_ids"] = mx.array(out["video_position_ids"])
            frame = lambda t, n: f"{t} {self.boi_token}{self.video_token * n}{self.eoi_token}"  # noqa: E731
            expansions[self.video_token] = [
                " ".join(frame(t, n) for t in stamps) for stamps, n in zip(out["timestamps"], out["num_soft_tokens"])
            ]
        return inputs, expansions

    def _require(self, part, kind: str) -> None:
        if part is None:
            raise MediaError(MODALITIES[kind].unsupported())

    def _expand(self, text: str, expansions: dict[str, list[str]]) -> str:
        """Replace the n-th placeholder of each kind by the n-th expansion; counts must agree.

        Placeholders marked as user text (see :meth:`render`) are not placeholders: they stay text."""
        kinds = {self.image_token: "image", self.audio_token: "audio", self.video_token: "video"}
        for token, kind in kinds.items():
            if token is None:
                continue
            found = len(re.findall(_UNMARKED + re.escape(token), text))
            given = len(expansions.get(token, []))
            if found != given:
                raise MediaError(f"the prompt has {found} {kind} placeholder(s) ({token}) but {given} {kind} input(s) were given")
        if not expansions:
            return text
        queues = {k: iter(v) for k, v in expansions.items()}
        pattern = "|".join(_UNMARKED + re.escape(t) for t in expansions)
        return re.sub(pattern, lambda m: next(queues[m.group(0)]), text)

    def prepare(
        self,
        prompt,
        images=None,
        audio=None,
        videos=None,
        enable_thinking: bool = False,
        max_soft_tokens: int | None = None,
        replies: dict[str, list[int]] | None = None,
        **template_kwargs,
    ) -> dict[str, Any]:
        """Model inputs for a prompt: a string (encoded as is), token ids, or chat messages whose
        content lists may hold ``{"type": "image" | "audio" | "video", ...}`` items (collected in
        order and added to ``images``/``audio``/``videos``). In chat messages, text is plain text:
        only the template's markup and real media become control tokens. ``replies``: see :meth:`render`."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            with contextlib.ExitStack() as downloads:  # media fetched from URLs are removed once decoded
                found = collect_media(prompt, downloads)
                images = (found["image"] + _as_list(images)) or None
                audio = (found["audio"] + _as_list(audio)) or None
                videos = (found["video"] + _as_list(videos)) or None
                text, reply_ids = self.render(prompt, enable_thinking, replies=replies, **template_kwargs)
                inputs, expansions = self._process_media(images, audio, videos, max_soft_tokens)
            inputs["input_ids"] = mx.array([self._encode_chat(self._expand(text, expansions), reply_ids)])
            return inputs
        if isinstance(prompt, str):
            return self(prompt, images, audio, videos, max_soft_tokens)
        if images or audio or videos:
            raise ValueError("media inputs need a text or chat prompt with placeholders, not token ids")
        return {"input_ids": mx.array([self.prompt_ids(prompt)])}

    @property
    def detokenizer(self):
        return self.tokenizer.detokenizer


# The 26B/31B template appends an empty reasoning channel to the generation prompt when thinking is
# off; the E2B/E4B template is the same without it (reference/GEMMA4.md).
_EMPTY_CHANNEL = """    {%- if not enable_thinking | default(false) -%}
        {{- '<|channel>thought\\n<channel|>' -}}
    {%- endif -%}
"""


def published_chat_template(small: bool = False) -> str:
    """The published Gemma 4 chat template: 26B/31B's, or with ``small`` E2B/E4B's. Used when a
    checkpoint has none."""
    template = resources.files("gemma4_mlx.processing").joinpath("templates/gemma4.jinja").read_text()
    if small:
        if _EMPTY_CHANNEL not in template:
            raise RuntimeError("the bundled chat template changed: update _EMPTY_CHANNEL")
        template = template.replace(_EMPTY_CHANNEL, "")
    return template


def _check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")


def _drop_reply_marks(obj):
    """User strings without any reply mark, so that none can be forged (as transformers drops its own marks)."""
    if isinstance(obj, str):
        return obj.replace(REPLY_MARK, "")
    if isinstance(obj, dict):
        return {k: _drop_reply_marks(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_drop_reply_marks(v) for v in obj]
    return obj


def check_ids(ids, vocab_size: int) -> list[int]:
    """Token ids given by a caller, as a list of ints inside ``[0, vocab_size)`` (checked in Python, so
    that ids too large for any integer type get a clear error rather than failing inside MLX)."""
    bad_type = next((t for t in ids if not isinstance(t, (int, np.integer)) or isinstance(t, bool)), None)
    if bad_type is not None:
        raise TypeError(
            f"a prompt is a string, a list of chat messages or a list of token ids (ints); got {bad_type!r} in a list"
        )
    bad = next((int(t) for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise TokenIdError(f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})")
    return [int(t) for t in ids]


def _as_list(x) -> list:
    if x is None:
        return []
    if isinstance(x, (list, tuple)):
        return list(x)
    return [x]




def collect_media(messages: list[dict[str, Any]], downloads: contextlib.ExitStack) -> dict[str, list]:
    """The media items of HF-style content lists, per kind, in order of appearance (``http(s)`` URLs
    are downloaded to temporary files that ``downloads`` removes when it closes)."""
    found: dict[str, list] = {"image": [], "audio": [], "video": []}
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for item in content:
            kind = item.get("type") if isinstance(item, dict) else None
            if kind in found:
                # The data under the item's own type, a URL or a path (as transformers accepts).
                source = next((item[k] for k in (kind, "url", "path") if item.get(k) is not None), None)
                if source is None:
                    raise MediaError(f"a {kind} item has no data: give it an {kind!r}, 'url' or 'path' key")
                found[kind].append(resolve_source(source, downloads))
    return found


def _eos_token_ids(model_path: Path, config: ModelConfig, tokenizer) -> set[int]:
    """Stop tokens: the config's and generation_config's eos ids, plus ``<turn|>`` (end of a turn)."""
    ids = set(config.eos_token_ids)
    gen = model_path / "generation_config.json"
    if gen.exists():
        eos = read_json_object(gen, "a generation config").get("eos_token_id")
        if eos is not None:
            eos = [eos] if isinstance(eos, int) else eos
            if not isinstance(eos, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in eos):
                raise ConfigError(f"{gen}: eos_token_id must be a token id or a list of them, not {eos!r}")
            ids.update(eos)
    end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    if isinstance(end_of_turn, int) and end_of_turn != tokenizer.unk_token_id:
        ids.add(end_of_turn)
    if not ids and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
