"""Prompts and media in: the tokenizer and chat template, images, audio, video and where media come from."""

from .processor import Processor

__all__ = ["Processor"]
