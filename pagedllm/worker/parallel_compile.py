"""Compile a warm-up's Triton kernels in parallel instead of one after another.

Triton compiles a kernel variant the first time it is launched, on the launching thread, so the
warm-up's ~20 variants compile serially (about 9 s on a cold cache on an H200 host, most of
a cold start). ``compile_only()`` is a scope in which a Triton launch does not run the kernel: it
submits the variant's compilation to a thread pool (Triton's ``AsyncCompileMode``; the LLVM and
``ptxas`` stages run outside the GIL) and returns. Leaving the scope waits for every compilation
and puts the results in Triton's in-memory cache, then builds each kernel's host launcher (a C
module, compiled once per signature) in the same pool, so the real warm-up that follows launches
without compiling anything.

Inside the scope nothing computed by a Triton kernel is valid (its output buffer keeps whatever
it held), so only passes whose results are thrown away may run there, and nothing may use such
a result as an index. The sampler may run there on plain metadata (no logprobs, no processors):
its token ids are then its whole result, used as nothing. Where this Triton has no
``AsyncCompileMode`` the scope yields False and the caller skips the dry pass.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor


@contextlib.contextmanager
def compile_only(max_workers: int | None = None) -> Iterator[bool]:
    """Scope of launch-free compilation (see the module doc); yields whether it is active."""
    try:
        from triton.runtime import _async_compile
        from triton.runtime.jit import JITFunction
    except ImportError:
        yield False
        return
    if not hasattr(_async_compile, "AsyncCompileMode") or _async_compile.active_mode.get() is not None:
        yield False
        return
    workers = max_workers or min(16, os.cpu_count() or 1)
    original_run, original_do_compile = JITFunction.run, JITFunction._do_compile
    submitted: dict = {}

    def submit_only(self, *args, grid, warmup, **kwargs):
        return original_run(self, *args, grid=grid, warmup=True, **kwargs)

    def submit_once(self, key, signature, device, *rest, **kw):
        # Until the scope ends a variant is not in Triton's cache, so every launch of it would
        # hash its source again to find the pending compilation: remember it here instead.
        memo = (id(self), key, device)
        if memo not in submitted:
            submitted[memo] = original_do_compile(self, key, signature, device, *rest, **kw)
        return submitted[memo]

    with ThreadPoolExecutor(workers, thread_name_prefix="triton-compile") as pool:
        with _async_compile.AsyncCompileMode(pool):
            JITFunction.run, JITFunction._do_compile = submit_only, submit_once
            try:
                yield True
            finally:
                JITFunction.run, JITFunction._do_compile = original_run, original_do_compile
        # Leaving AsyncCompileMode waited for every compilation (and raised the first error).
        kernels = [getattr(future, "kernel", None) for future in submitted.values()]
        list(pool.map(_build_launcher, [kernel for kernel in kernels if kernel is not None]))


def _build_launcher(kernel) -> None:
    """Build a compiled kernel's host launcher (a small C module Triton compiles with the system C
    compiler on its first launch, one per signature, kept in Triton's cache directory) so that the
    first launch finds it there. The compiler runs outside the GIL: done here for every kernel of
    the scope at once, on a cold cache it took ~0.1-0.3 s per signature on the main thread. Best
    effort: on any failure the first launch builds it (and reports the error) as usual."""
    try:
        from triton.runtime.driver import driver

        driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception:  # noqa: BLE001 - the launch that follows redoes it and raises properly
        pass
