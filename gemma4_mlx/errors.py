"""The errors gemma4-mlx raises for bad input, in one place (no MLX needed to import them).

Each is a ``ValueError`` (``FileNotFoundError`` is used as is for missing folders and files), so
callers that catch ``ValueError`` keep working; the messages name the file, option or input at fault.
The modules that raise them re-export them where they were first documented.
"""


class UnsupportedModelError(ValueError):
    """The checkpoint is not a Gemma 4 model (or uses a Gemma 4 feature we do not run)."""


class ConfigError(UnsupportedModelError):
    """A ``config.json`` that cannot be read: not UTF-8, not JSON, not an object, or a field of the wrong type."""


class CheckpointError(ValueError):
    """The checkpoint's files are missing, corrupt or do not match the config."""


class MediaError(ValueError):
    """An image, audio clip or video that cannot be read, or that the model cannot take."""


class TokenIdError(ValueError):
    """A token id outside the model's vocabulary."""


class ContextLengthError(ValueError):
    """The prompt does not fit in the model's context window."""


class OptionError(ValueError):
    """A generation option outside its allowed range (the message names the option and the range)."""


class DrafterMismatchError(ValueError):
    """A draft model (assistant) that was not made for the target model: widths, vocabulary or K/V shapes differ."""


class PeerLostError(RuntimeError):
    """Another process of a sharded model stopped or cannot be reached (gemma4_mlx.distributed)."""


__all__ = [
    "UnsupportedModelError",
    "ConfigError",
    "CheckpointError",
    "MediaError",
    "TokenIdError",
    "ContextLengthError",
    "OptionError",
    "DrafterMismatchError",
    "PeerLostError",
]
