"""Model folders: a local path as is, or a Hub repo id fetched with huggingface_hub."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

# What a checkpoint folder needs; anything else in a Hub repo (original/ PyTorch files, GGUF...) is skipped.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.md"]


def resolve_model_path(
    path_or_repo_id: str | Path, revision: str | None = None, progress: Callable[[str], None] | None = None,
    weights: list[str] | None = None,
) -> Path:
    """A local folder as is, or a Hub repo id downloaded (or found in the cache) with huggingface_hub.

    ``progress``, if given, receives huggingface_hub's progress bars as text while downloading
    (the app shows them in the page); they still print to the terminal as usual. ``weights``: only
    these safetensors files (a pipeline process's shards; ``[]``: none, for the config and tokenizer)."""
    path = Path(path_or_repo_id).expanduser()
    if path.is_dir():
        # Absolute, so that paths built from it stay right whatever the working directory is later.
        return path.absolute()
    if path.exists():
        raise FileNotFoundError(f"{path} is a file; pass the model folder that holds config.json")
    text = str(path_or_repo_id)
    looks_like_repo = re.fullmatch(r"[\w.-]+/[\w.-]+", text) is not None and not text.startswith((".", "/", "~"))
    if not looks_like_repo:
        raise FileNotFoundError(f"model folder not found: {path}")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        tqdm_class = _reporting_tqdm(progress) if progress is not None else None
        patterns = _HUB_PATTERNS if weights is None else [p for p in _HUB_PATTERNS if p != "*.safetensors"] + list(weights)
        return Path(snapshot_download(text, revision=revision, allow_patterns=patterns, tqdm_class=tqdm_class))
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"{text!r} is neither a local folder nor a Hub repository") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        raise FileNotFoundError(
            f"could not download {text!r} from the Hugging Face Hub and it is not in the local cache ({e})"
        ) from None


def _reporting_tqdm(progress: Callable[[str], None]):
    """A tqdm class that also hands each refreshed bar to ``progress`` as one line of text.

    huggingface_hub takes a ``tqdm_class`` for its byte counters; it has no callback of its own.
    Built on huggingface_hub's tqdm, so that ``HF_HUB_DISABLE_PROGRESS_BARS`` still applies."""
    from huggingface_hub.utils import tqdm

    class ReportingTqdm(tqdm):
        def display(self, msg=None, pos=None):
            try:
                progress(str(self).strip())
            except Exception:  # a failing reporter must not break the download
                pass
            return super().display(msg, pos)

    return ReportingTqdm
