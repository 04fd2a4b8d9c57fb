import os
from pathlib import Path

import pytest

import torchvision_guard  # first: before anything imports transformers' vision code
from checkpoints import FAMILIES, build_hf_model, build_hf_unified, save_checkpoint

if torchvision_guard.declared():  # the CLIs the tests launch import transformers too: the same guard there
    startup = str(Path(__file__).parent / "startup")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (startup, os.environ.get("PYTHONPATH")) if p)


class Family:
    """A tiny HF reference model, its checkpoint folder, and our model loaded from it."""

    def __init__(self, name, hf_model, path):
        import gemma4_mlx

        self.name = name
        self.hf = hf_model
        self.path = path
        self.model, self.processor = gemma4_mlx.load(path)


_FAMILIES: dict[str, Family] = {}


def _family(name: str, tmp_path_factory) -> Family:
    """One checkpoint per family for the whole session, whichever fixture asks first."""
    if name not in _FAMILIES:
        hf = build_hf_unified() if name == "unified" else build_hf_model(name)
        # The 31B-like and 12B families are saved in the published config form, the others in transformers'.
        form = "published" if name in ("dense31b", "unified") else "transformers"
        _FAMILIES[name] = Family(name, hf, save_checkpoint(hf, tmp_path_factory.mktemp(name), form=form))
    return _FAMILIES[name]


@pytest.fixture(scope="session", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """Every Gemma 4 shape family: e2b, moe26b, dense31b (Gemma4ForConditionalGeneration, text only)."""
    return _family(request.param, tmp_path_factory)


@pytest.fixture(scope="session", params=sorted(FAMILIES) + ["unified"])
def any_family(request, tmp_path_factory):
    """The three families and the 12B's unified model (Gemma4UnifiedForConditionalGeneration with its
    embedders), for the parity tests. The family-wide feature tests (caches, chat, drafting...) run
    the three: as a text decoder the 12B is the 31B-like family with one K/V head in full layers,
    which the parity tests cover."""
    return _family(request.param, tmp_path_factory)


@pytest.fixture(scope="session")
def e2b(tmp_path_factory):
    hf = build_hf_model("e2b")
    return Family("e2b", hf, save_checkpoint(hf, tmp_path_factory.mktemp("e2b_single")))


@pytest.fixture(scope="module")
def app_cache(tmp_path_factory):
    """The app's cache (conversions, the page's storage secret) in a temporary folder."""
    import app.backend

    with pytest.MonkeyPatch.context() as mp:
        folder = tmp_path_factory.mktemp("cache")
        mp.setattr(app.backend, "CACHE_DIR", folder)
        yield folder
