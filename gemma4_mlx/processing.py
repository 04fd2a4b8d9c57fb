"""The processor: tokenizer, chat template and stop tokens of a checkpoint.

The tokenizer is loaded from the checkpoint's own files with transformers (``AutoTokenizer``) and
wrapped by mlx-lm's ``TokenizerWrapper``, which picks the right streaming detokenizer. Text-only
for now; images, audio and video are added by the multimodal processor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

import mlx.core as mx

from .config import ModelConfig

END_OF_TURN = "<turn|>"


class Processor:
    """Turns prompts or chat messages into token ids, and token ids back into text."""

    def __init__(self, tokenizer, config: ModelConfig, eos_token_ids: Iterable[int]):
        self.tokenizer = tokenizer  # mlx_lm.tokenizer_utils.TokenizerWrapper
        self.config = config
        self.eos_token_ids = set(eos_token_ids)
        self.tokenizer.eos_token_ids = self.eos_token_ids

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
        return cls(tokenizer, config, _eos_token_ids(model_path, config, tokenizer))

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

    def __call__(self, text: str | list[str] | None = None, **kwargs) -> dict[str, mx.array]:
        """``processor(text=...)`` -> ``{"input_ids": mx.array [B, L]}`` for ``model(**inputs)``."""
        if text is None:
            raise ValueError("processor needs text")
        texts = [text] if isinstance(text, str) else list(text)
        ids = [self.encode(t) for t in texts]
        if len({len(i) for i in ids}) != 1:
            raise ValueError("texts of different token lengths cannot be batched without padding")
        return {"input_ids": mx.array(ids)}

    @property
    def detokenizer(self):
        return self.tokenizer.detokenizer


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
