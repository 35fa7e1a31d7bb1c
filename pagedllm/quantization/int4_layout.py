"""The names of the int4 serving layouts and the word-row layout's run length: shared by the weight
code (``int4.py``, which documents the layouts) and the kernels (``kernels/int4_gemm.py``) without
either importing the other."""

from __future__ import annotations

PACK = 8  # int4 values per int32
ROWS_LAYOUT = "rows"  # qweight [N, K / 8] (int4.py's module doc)
N8_LAYOUT = "n8"  # qweight [N / 8, K] (int4.py's module doc)


def n8_run(in_features: int, group_size: int) -> int | None:
    """The columns a GEMV thread streams in the word-row layout (``run``, 32 to 4 words: a power
    of two dividing the group size, a warp's 32 runs dividing K, preferably four warps' runs), or
    None where K is no multiple of 128."""
    runs = [r for r in (32, 16, 8, 4) if group_size % r == 0 and in_features % (32 * r) == 0]
    return next((r for r in runs if in_features % (128 * r) == 0), runs[0] if runs else None)
