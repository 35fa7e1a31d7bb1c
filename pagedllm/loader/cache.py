"""The on-disk cache for things derived from a GGUF file (tokenizer, config, dequantized weights).

Layout: ``$PAGEDLLM_CACHE_DIR`` (default ``~/.cache/pagedllm``) ``/gguf/<stem>-<key>/`` where ``key``
hashes the GGUF file's content (``content_fingerprint``), not its path: every install of the same model file (one per virtual environment) shares one entry, and
replacing the file with another content makes a new one. For the embedded SmolLM2 an entry holds
about 520 MiB, nearly all of it the dequantized float32 weights (``weights.safetensors``).

Every entry is written to a temporary name and renamed into place, so concurrent processes never
see a half-written entry; when the cache is not writable we carry on without it. Stale entries
are removed when a new entry is made (``prune_stale_entries``): those unused for
``STALE_AFTER_S`` (each use touches the folder) and those of earlier, path-keyed versions of the
cache for the same file name.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from pagedllm import envs

logger = logging.getLogger(__name__)

# Bump when the content of a cache entry changes meaning (e.g. a fix in the GGUF conversion).
CACHE_FORMAT_VERSION = 2
STALE_AFTER_S = 14 * 24 * 3600
# Written into every entry of this cache format; entries without it are from path-keyed versions.
MARKER = "source.txt"


def cache_root() -> Path:
    """``$PAGEDLLM_CACHE_DIR`` or ``~/.cache/pagedllm``."""
    return envs.PAGEDLLM_CACHE_DIR


def content_fingerprint(path: str | os.PathLike) -> str:
    """A SHA-256 of the file's bytes (16 hex digits): the same for every copy of one file, whatever
    its path or mtime. Hashing 130 MB takes ~0.3 s, so the result is remembered per (path, size,
    mtime) in ``gguf/.fingerprints/``: each install location hashes its copy once."""
    path = Path(path).resolve()
    stat = path.stat()
    ident = f"{path}|{stat.st_size}|{stat.st_mtime_ns}|v{CACHE_FORMAT_VERSION}"
    memo = cache_root() / "gguf" / ".fingerprints" / hashlib.sha256(ident.encode()).hexdigest()[:16]
    try:
        known = memo.read_text().strip()
        if len(known) == 16:
            return known
    except OSError:
        pass
    h = hashlib.sha256(f"v{CACHE_FORMAT_VERSION}|".encode())
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    digest = h.hexdigest()[:16]
    write_atomically(memo, lambda tmp: tmp.write_text(digest + "\n"))
    return digest


def gguf_cache_folder(gguf_path: str | os.PathLike) -> Path:
    """The cache folder of one GGUF file's content (not created here; touched when it exists, so
    that pruning sees it in use)."""
    path = Path(gguf_path).resolve()
    folder = cache_root() / "gguf" / f"{path.stem}-{content_fingerprint(path)}"
    if folder.is_dir():
        try:
            os.utime(folder)
        except OSError:
            pass
    return folder


def prune_stale_entries(new_entry: Path, now: float | None = None) -> list[Path]:
    """Remove the entries beside ``new_entry`` that are stale: unused for ``STALE_AFTER_S``, or
    left by a path-keyed version of the cache for the same file name. Returns what it removed."""
    now = time.time() if now is None else now
    stem = new_entry.name.rsplit("-", 1)[0]
    removed = []
    try:
        siblings = [p for p in new_entry.parent.iterdir()
                    if p.is_dir() and p != new_entry and ".tmp-" not in p.name and not p.name.startswith(".")]
    except OSError:
        return removed
    for entry in siblings:
        try:
            legacy = entry.name.rsplit("-", 1)[0] == stem and not (entry / MARKER).exists()
            if legacy or now - entry.stat().st_mtime > STALE_AFTER_S:
                shutil.rmtree(entry)
                removed.append(entry)
        except OSError:
            continue  # another process is using or removing it
    if removed:
        logger.info("pagedllm cache: removed %d stale entr%s: %s", len(removed), "y" if len(removed) == 1 else "ies",
                    ", ".join(p.name for p in removed))
    return removed


def ensure_entry(folder: Path, source: Path) -> None:
    """Create a GGUF cache entry (with its marker naming the source file) and prune the stale ones;
    nothing when it exists. Errors are logged, never raised: the cache is an optimisation."""
    if (folder / MARKER).exists():
        return
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / MARKER).write_text(f"{source}\n")
    except OSError as e:
        logger.warning("pagedllm cache: could not create %s (%s)", folder, e)
        return
    prune_stale_entries(folder)


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
