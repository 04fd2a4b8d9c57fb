"""The processor: tokenizer, chat template, stop tokens, and the image/audio/video processors.

The tokenizer is loaded from the checkpoint's own files with transformers (``AutoTokenizer``) and
wrapped by mlx-lm's ``TokenizerWrapper``, which picks the right streaming detokenizer. Like HF's
``Gemma4Processor``, ``processor(text=..., images=..., audio=..., videos=...)`` expands each
placeholder (``<|image|>``, ``<|audio|>``, ``<|video|>``) into begin/end markers around one token per
soft token, and returns arrays that ``model(**inputs)`` accepts.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable

import mlx.core as mx

from .config import ModelConfig
from .multimodal import MediaError, resolve_source

END_OF_TURN = "<turn|>"


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

    @classmethod
    def from_pretrained(cls, model_path: str | Path, config: ModelConfig | None = None) -> "Processor":
        from mlx_lm.tokenizer_utils import load as load_tokenizer

        from .tiny import bundled_chat_template

        model_path = Path(model_path)
        if config is None:
            config = ModelConfig.from_file(model_path / "config.json")
        if not any((model_path / f).exists() for f in ("tokenizer.json", "tokenizer.model")):
            raise FileNotFoundError(f"no tokenizer files (tokenizer.json) in {model_path}")
        tokenizer = load_tokenizer(model_path)
        if tokenizer.chat_template is None:
            # Prefer the checkpoint's own template; fall back to the published Gemma 4 one.
            tokenizer._tokenizer.chat_template = bundled_chat_template()
        image_processor = audio_extractor = video_processor = None
        if config.vision_config:
            from .image_processing import ImageProcessor
            from .video_processing import VideoProcessor

            image_processor = ImageProcessor.from_pretrained(model_path)
            video_processor = VideoProcessor.from_pretrained(model_path)
        if config.audio_config:
            from .audio_processing import AudioFeatureExtractor

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
        """Render chat messages with the checkpoint's template (thinking on/off via ``enable_thinking``)."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
        text = self.tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
            tokenize=False,
            **kwargs,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def prompt_ids(self, prompt: str | list[dict[str, Any]] | list[int], enable_thinking: bool = False, **kwargs) -> list[int]:
        """Token ids for a raw prompt string, a list of chat messages, or ids given as is."""
        if isinstance(prompt, str):
            return self.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if isinstance(prompt, mx.array):
            return prompt.reshape(-1).tolist()
        # The template writes <bos> itself, so the rendered text is encoded without specials.
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
        ``<|video|>``; the chat template writes them). ``max_soft_tokens`` is the image token budget
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
        inputs: dict[str, Any] = {}
        expansions: dict[str, list[str]] = {}
        if images is not None:
            images = _as_list(images)
            self._require(self.image_processor, "image")
            out = self.image_processor(images, max_soft_tokens=max_soft_tokens)
            inputs["pixel_values"] = mx.array(out["pixel_values"])
            inputs["image_position_ids"] = mx.array(out["image_position_ids"])
            expansions[self.image_token] = [self.boi_token + self.image_token * n + self.eoi_token for n in out["num_soft_tokens"]]
        if audio is not None:
            audio = _as_list(audio)
            self._require(self.audio_extractor, "audio")
            out = self.audio_extractor(audio)
            inputs["input_features"] = mx.array(out["input_features"])
            inputs["input_features_mask"] = mx.array(out["input_features_mask"])
            if min(out["num_soft_tokens"]) == 0:
                raise MediaError("an audio clip is too short to give any audio token (at least 0.01 s is needed)")
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
        text = self._expand(text, expansions)
        inputs["input_ids"] = mx.array([self.encode(text, add_special_tokens)])
        return inputs

    def _require(self, part, kind: str) -> None:
        if part is None:
            tower = "audio" if kind == "audio" else "vision"
            raise MediaError(f"this model has no {tower} tower: it cannot take {kind} input")

    def _expand(self, text: str, expansions: dict[str, list[str]]) -> str:
        """Replace the n-th placeholder of each kind by the n-th expansion; counts must agree."""
        for token in (self.image_token, self.audio_token, self.video_token):
            if token is None:
                continue
            found = text.count(token)
            given = len(expansions.get(token, []))
            if found != given:
                kind = {self.image_token: "image", self.audio_token: "audio", self.video_token: "video"}[token]
                raise MediaError(f"the prompt has {found} {kind} placeholder(s) ({token}) but {given} {kind} input(s) were given")
        if not expansions:
            return text
        queues = {k: iter(v) for k, v in expansions.items()}
        pattern = "|".join(re.escape(t) for t in expansions)
        return re.sub(pattern, lambda m: next(queues[m.group(0)]), text)

    def prepare(
        self,
        prompt,
        images=None,
        audio=None,
        videos=None,
        enable_thinking: bool = False,
        max_soft_tokens: int | None = None,
        **template_kwargs,
    ) -> dict[str, Any]:
        """Model inputs for a prompt: a string, token ids, or chat messages whose content lists may
        hold ``{"type": "image" | "audio" | "video", ...}`` items (collected in order and added to
        ``images``/``audio``/``videos``)."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            found = collect_media(prompt)
            images = (found["image"] + _as_list(images)) or None
            audio = (found["audio"] + _as_list(audio)) or None
            videos = (found["video"] + _as_list(videos)) or None
            text = self.apply_chat_template(prompt, enable_thinking=enable_thinking, **template_kwargs)
            return self(text, images, audio, videos, max_soft_tokens, add_special_tokens=False)
        if isinstance(prompt, str):
            return self(prompt, images, audio, videos, max_soft_tokens)
        if images or audio or videos:
            raise ValueError("media inputs need a text or chat prompt with placeholders, not token ids")
        return {"input_ids": mx.array([self.prompt_ids(prompt)])}

    @property
    def detokenizer(self):
        return self.tokenizer.detokenizer


def _as_list(x) -> list:
    if x is None:
        return []
    if isinstance(x, (list, tuple)):
        return list(x)
    return [x]


_MEDIA_KEYS = {"image": ("image", "url", "path"), "audio": ("audio", "url", "path"), "video": ("video", "url", "path")}


def collect_media(messages: list[dict[str, Any]]) -> dict[str, list]:
    """The media items of HF-style content lists, per kind, in order of appearance."""
    found: dict[str, list] = {"image": [], "audio": [], "video": []}
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for item in content:
            kind = item.get("type") if isinstance(item, dict) else None
            if kind in found:
                source = next((item[k] for k in _MEDIA_KEYS[kind] if item.get(k) is not None), None)
                if source is None:
                    raise MediaError(f"a {kind} item has no data: give it an {kind!r}, 'url' or 'path' key")
                found[kind].append(resolve_source(source))
    return found


def _eos_token_ids(model_path: Path, config: ModelConfig, tokenizer) -> set[int]:
    """Stop tokens: the config's and generation_config's eos ids, plus ``<turn|>`` (end of a turn)."""
    ids = set(config.eos_token_ids)
    gen = model_path / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
    end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    if isinstance(end_of_turn, int) and end_of_turn != tokenizer.unk_token_id:
        ids.add(end_of_turn)
    if not ids and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
