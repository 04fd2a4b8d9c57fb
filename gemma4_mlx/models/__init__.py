"""The Gemma 4 models as pure MLX modules: no file or network I/O and no host syncs in the forward
pass (checks that need values on the host happen where requests enter, in ``generation``)."""

from .cache import make_cache
from .gemma4 import Gemma4Model

__all__ = ["Gemma4Model", "make_cache"]
