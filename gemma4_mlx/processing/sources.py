"""Where media come from: ``file://`` URLs, and ``http(s)://`` URLs fetched to temporary files.

A download is streamed to a temporary file (never held whole in memory), refused past a size limit,
and removed when the ``ExitStack`` it was registered with closes, which the processor does as soon
as the media are decoded. Other sources (paths, PIL images, arrays) pass through unchanged.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

from ..errors import MediaError

MAX_DOWNLOAD_BYTES = 256 * 1024 * 1024  # a long 1080p clip fits; the decoders bound pixels and frames
DOWNLOAD_TIMEOUT = 30.0  # seconds without data before a download is given up
_CHUNK = 1 << 20


def resolve_source(source, cleanup: contextlib.ExitStack, max_bytes: int | None = None):
    """A media source as the loaders take it. ``file://`` URLs become paths; ``http(s)://`` URLs are
    downloaded to a temporary file that ``cleanup`` removes when it closes."""
    if not isinstance(source, str) or "://" not in source:
        return source
    url = urllib.parse.urlparse(source)
    if url.scheme == "file":
        return urllib.parse.unquote(url.path)
    if url.scheme in ("http", "https"):
        return download(source, cleanup, max_bytes)
    raise MediaError(f"unsupported media URL scheme {url.scheme!r} in {source}")


def download(url: str, cleanup: contextlib.ExitStack, max_bytes: int | None = None) -> str:
    """Stream ``url`` into a temporary file (removed by ``cleanup``); at most ``max_bytes``
    (default :data:`MAX_DOWNLOAD_BYTES`)."""
    max_bytes = MAX_DOWNLOAD_BYTES if max_bytes is None else max_bytes
    limit = f"{max_bytes / 1e6:.0f} MB"
    suffix = Path(urllib.parse.urlparse(url).path).suffix[:16]
    fd, name = tempfile.mkstemp(prefix="gemma4-media-", suffix=suffix)
    cleanup.callback(_remove, name)  # registered first: removed whatever happens below
    try:
        with os.fdopen(fd, "wb") as f, urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT) as response:
            declared = response.headers.get("Content-Length")
            if declared and declared.isdigit() and int(declared) > max_bytes:
                raise MediaError(f"{url} is {int(declared) / 1e6:.0f} MB, more than the {limit} a media download may be")
            size = 0
            while chunk := response.read(_CHUNK):
                size += len(chunk)
                if size > max_bytes:
                    raise MediaError(f"{url} is more than the {limit} a media download may be")
                f.write(chunk)
    except OSError as e:  # URLError, HTTPError, timeouts and disk errors are all OSErrors
        raise MediaError(f"cannot download {url}: {getattr(e, 'reason', None) or e}") from None
    return name


def _remove(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(name)
