"""The on-disk cache for things derived from a GGUF file (tokenizer, config, dequantized weights).

Layout: ``$PAGEDLLM_CACHE_DIR`` (default ``~/.cache/pagedllm``) ``/gguf/<stem>-<key>/`` where ``key``
hashes the GGUF file's resolved path, size and mtime, so editing or replacing the file invalidates
its entry. Every entry is written to a temporary name and renamed into place, so concurrent
processes never see a half-written entry; when the cache is not writable we carry on without it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from pagedllm import envs

logger = logging.getLogger(__name__)

# Bump when the content of a cache entry changes meaning (e.g. a fix in the GGUF conversion).
CACHE_FORMAT_VERSION = 1


def cache_root() -> Path:
    """``$PAGEDLLM_CACHE_DIR`` or ``~/.cache/pagedllm``."""
    return envs.PAGEDLLM_CACHE_DIR


def gguf_cache_folder(gguf_path: str | os.PathLike) -> Path:
    """The cache folder of one GGUF file (not created here)."""
    path = Path(gguf_path).resolve()
    stat = path.stat()
    ident = f"{path}|{stat.st_size}|{stat.st_mtime_ns}|v{CACHE_FORMAT_VERSION}"
    key = hashlib.sha256(ident.encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{path.stem}-{key}"


def write_atomically(target: Path, write: Callable[[Path], None]) -> bool:
    """Call ``write(tmp)`` to build a file or folder at a temporary path, then rename it to ``target``.

    Returns False (and logs why) when the cache cannot be written; another process winning the race
    to create ``target`` counts as success.
    """
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        os.replace(tmp, target)
        return True
    except OSError as e:
        if target.exists():
            return True  # a concurrent writer got there first (renaming onto a non-empty folder fails)
        logger.warning("pagedllm cache: could not write %s (%s); continuing without the cache", target, e)
        return False
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink(missing_ok=True)
