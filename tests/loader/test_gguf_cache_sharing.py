"""The GGUF cache is keyed by the file's content: every install location of one model file shares
one entry (520 MiB for SmolLM2), and stale entries are pruned when a new one is made."""

from __future__ import annotations

import os
import time

from pagedllm.loader.cache import MARKER, STALE_AFTER_S, ensure_entry, gguf_cache_folder, prune_stale_entries


def _model_file(folder, content: bytes):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.Q4.gguf"
    path.write_bytes(content)
    return path


def test_two_install_locations_share_one_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    content = os.urandom(3 << 20)
    a = _model_file(tmp_path / "venv-a", content)
    b = _model_file(tmp_path / "venv-b", content)
    os.utime(b, (time.time() - 3600, time.time() - 3600))  # pip gives each copy its own mtime
    assert gguf_cache_folder(a) == gguf_cache_folder(b)
    changed = bytearray(content)
    changed[len(content) // 2] ^= 0xFF  # one byte in the middle (the weights) differs
    c = _model_file(tmp_path / "venv-c", bytes(changed))
    assert gguf_cache_folder(c) != gguf_cache_folder(a)


def test_stale_and_path_keyed_entries_are_pruned_when_an_entry_is_made(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    model = _model_file(tmp_path / "venv", os.urandom(1 << 20))
    entry = gguf_cache_folder(model)
    root = entry.parent
    legacy = root / "model.Q4-0123456789abcdef"  # the path-keyed layout: same stem, no marker
    old = root / "other-model-fedcba9876543210"
    fresh = root / "third-model-00112233aabbccdd"
    for folder in (legacy, old, fresh):
        (folder / "weights").mkdir(parents=True)
        if folder is not legacy:
            (folder / MARKER).write_text("x\n")
    long_ago = time.time() - STALE_AFTER_S - 60
    os.utime(old, (long_ago, long_ago))

    ensure_entry(entry, model)
    assert (entry / MARKER).read_text().strip() == str(model)
    assert not legacy.exists() and not old.exists() and fresh.exists()


def test_an_entry_in_use_is_touched_so_pruning_keeps_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    used, unused = (_model_file(tmp_path / name, os.urandom(1 << 20)) for name in ("a", "b"))
    used_entry, unused_entry = gguf_cache_folder(used), gguf_cache_folder(unused)
    ensure_entry(used_entry, used)
    ensure_entry(unused_entry, unused)
    long_ago = time.time() - STALE_AFTER_S - 60
    for folder in (used_entry, unused_entry):
        os.utime(folder, (long_ago, long_ago))
    assert gguf_cache_folder(used) == used_entry  # a load looks the entry up: that is a use
    newest = used_entry.parent / "new-0000000000000000"
    newest.mkdir()
    assert prune_stale_entries(newest) == [unused_entry]
    assert used_entry.exists()
