"""Start-up hook of the Python processes the tests launch (the CLIs), put on PYTHONPATH by conftest.py
only where torchvision's compiled ops do not load: they import transformers too, so they need the same
guard (see torchvision_guard.py). Another sitecustomize further on the path still runs."""

import importlib.machinery
import importlib.util
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_here))
import torchvision_guard  # noqa: E402,F401

sys.path.remove(os.path.dirname(_here))
_other = importlib.machinery.PathFinder.find_spec("sitecustomize", [p for p in sys.path if p != _here])
if _other is not None:
    _other.loader.exec_module(importlib.util.module_from_spec(_other))
