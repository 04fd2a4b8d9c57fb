"""The Gemma 4 models as pure MLX modules: no file or network I/O and no host syncs in the forward
pass (checks that need values on the host happen where requests enter, in ``generation``)."""

from ..config import ModelConfig
from .cache import make_cache
from .gemma4 import Gemma4Model
from .unified import Gemma4UnifiedModel


def build_model(config: ModelConfig) -> Gemma4Model:
    """The model a config describes: :class:`Gemma4UnifiedModel` for the 12B, else :class:`Gemma4Model`."""
    return Gemma4UnifiedModel(config) if config.is_unified else Gemma4Model(config)


__all__ = ["Gemma4Model", "Gemma4UnifiedModel", "build_model", "make_cache"]
