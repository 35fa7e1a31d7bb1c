"""Device side of programmatic dependent launch (``pagedllm/pdl.py`` says when it is on and the
invariant each kernel keeps): the two calls a PDL kernel makes, both no-ops when ``USE_PDL`` is
false (they compile away)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def wait_for_inputs(USE_PDL: tl.constexpr):
    """Block until the kernel ahead on the stream has completed and its writes are visible (a no-op
    without PDL). Every program calls it before its first read of an earlier kernel's output and
    before its first store."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def allow_dependents(USE_PDL: tl.constexpr):
    """Let the next kernel on the stream be launched once every program has got here (a no-op
    without PDL). Call it after the main loop, before the epilogue's stores."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()

