"""torchvision for the tests (transformers' video processor resizes with it), importable even where
its compiled ops do not load.

The torchvision 0.28.0 wheel on PyPI is built against CUDA torch. Next to torch 2.13.0+cpu its C++
extension (``_C.so``) fails to load, which torchvision tolerates, but ``_meta_registrations.py`` then
registers fake kernels for ``torchvision::nms`` and ``torchvision::qnms`` regardless and fails with
"operator torchvision::nms does not exist". transformers imports torchvision whenever it is installed,
so that error would break every transformers vision import. Declaring the two operators (schemas, no
kernels) lets the import finish: the resize and normalize functions are plain torch, and ``nms`` still
raises torchvision's own "Couldn't load custom C++ ops". conftest.py imports this module first (and
the processes the tests launch, through startup/sitecustomize.py); it only tries to load the
extension, so that sessions which never need torchvision do not import it.
"""

from __future__ import annotations

import importlib.util
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

import torch

_MISSING_OPS = ("nms", "qnms")  # what 0.28.0's _meta_registrations.py registers unguarded
_declarations = None  # the torch.library.Library declaring them (None: not needed); kept alive


def _declare_ops_if_extension_fails() -> None:
    global _declarations
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return  # not installed: the tests that need it skip
    folder = Path(spec.origin).parent
    extension = next((folder / f"_C{s}" for s in EXTENSION_SUFFIXES if (folder / f"_C{s}").is_file()), None)
    if extension is not None:
        try:
            torch.ops.load_library(str(extension))  # as torchvision.extension does; loading again is a no-op
            return
        except OSError:
            pass
    _declarations = torch.library.Library("torchvision", "DEF")
    for op in _MISSING_OPS:
        _declarations.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


def declared() -> bool:
    """Whether the operators had to be declared (torchvision installed, its extension unusable)."""
    return _declarations is not None


def import_torchvision():
    """(torchvision, None), or (None, the reason it cannot be used)."""
    try:
        import torchvision
    except Exception as e:  # noqa: BLE001 - whatever fails, the tests that need it skip with the reason
        return None, f"torchvision cannot be imported ({type(e).__name__}: {e}); pip install -e '.[test]'"
    return torchvision, None


_declare_ops_if_extension_fails()
