"""``python -m app``: a local Gradio chat with Gemma 4 (see app/__main__.py for the options)."""

from .backend import ModelHolder
from .ui import build_app

__all__ = ["ModelHolder", "build_app"]
