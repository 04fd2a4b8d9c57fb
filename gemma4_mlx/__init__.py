"""gemma4-mlx: Google's Gemma 4 on Apple's MLX.

    import gemma4_mlx
    model, processor = gemma4_mlx.load("google/gemma-4-E2B-it")
    for chunk in gemma4_mlx.stream_generate(model, processor, [{"role": "user", "content": "Hi!"}]):
        print(chunk.text, end="", flush=True)
"""

from .config import LayerSpec, ModelConfig, TextConfig
from .errors import (
    CheckpointError,
    ConfigError,
    ContextLengthError,
    DrafterMismatchError,
    MediaError,
    OptionError,
    TokenIdError,
    UnsupportedModelError,
)
from .generation.chat import Chat, ChatEngine, ReplyOptions
from .generation.options import GenerationOptions
from .generation.stream import GenerationChunk, generate, stream_generate
from .loading import load, load_model
from .loading.assistant import load_drafter
from .models.gemma4 import Gemma4Model
from .processing.processor import Processor

__version__ = "0.1.0"

__all__ = [
    "load",
    "Chat",
    "ChatEngine",
    "ReplyOptions",
    "GenerationOptions",
    "load_model",
    "load_drafter",
    "generate",
    "stream_generate",
    "GenerationChunk",
    "Gemma4Model",
    "Processor",
    "ModelConfig",
    "TextConfig",
    "LayerSpec",
    "CheckpointError",
    "ConfigError",
    "ContextLengthError",
    "DrafterMismatchError",
    "MediaError",
    "OptionError",
    "TokenIdError",
    "UnsupportedModelError",
]
