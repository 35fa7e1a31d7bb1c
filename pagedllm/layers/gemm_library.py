"""Per-shape choice between cuBLAS and cuBLASLt for the decode GEMMs on CUDA.

torch sends a half-precision ``F.linear`` to cuBLAS unless ``preferred_blas_library`` says
cuBLASLt, and the two pick different kernels. At 8-256 rows neither wins everywhere (cuBLAS may
split K and add a reduce kernel where cuBLASLt does not, and the other way round at other row
counts). So start-up times both on the model's own weights, for each weight shape and each
CUDA-graph batch size, before the graphs are captured (``GemmLibrary.tune``, called by
``KernelPlan.tune_gemms``), and the model's linear layers then call the faster one.

A ``GemmLibrary`` is the choice table of one engine (its ``KernelPlan``); every linear layer that
plan prepared for CUDA holds the same one. Nothing here is process-global.

Invariant: ``linear(x, w, b)`` is ``F.linear(x, w, b)`` up to the GEMM kernel's summation order;
``linear_add_(x, w, r)`` (the residual-stream forward's o_proj and down_proj) is ``r += F.linear(x, w)``
with one rounding, on the library chosen for ``F.linear`` (the add reads r in the same kernel).
The table holds only ``(N, K, rows)`` keys where cuBLASLt was measured faster by more than the
margin (or that ``set_choices`` put there); every other call (other shapes, other row counts,
prefill, the CPU) is plain F.linear under the process's default library.
Cost: one dict lookup per call; a hit sets the global preferred library around the call, which
matters only on the host and only for eager calls (in a CUDA graph the choice is captured).
``tune`` costs about one GPU pass over the weights per (shape, rows) pair and library, plus a short
idle kernel per pair so that the timed launches are queued before the GPU reaches them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F

_REPS = 2  # timed passes per library, interleaved; the minimum counts
_QUEUE_CYCLES = 4_000_000  # ~2 ms idle kernel (at ~2 GHz) while the timed launches are queued


class GemmLibrary:
    """The ``(N, K, rows)`` calls that go to cuBLASLt, and the GEMM calls that follow that table.

    ``margin``: cuBLASLt is chosen where ``tune`` timed it below ``(1 - margin)`` x cuBLAS's time
    (the device's ``DeviceTuning.cublaslt_margin``)."""

    def __init__(self, margin: float) -> None:
        self.margin = margin
        self._cublaslt: set[tuple[int, int, int]] = set()

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear`` on the library ``tune`` measured faster for this weight shape and row count."""
        if self._uses_cublaslt(x, weight):
            with blas_library("cublaslt"):
                return F.linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def linear_add_(self, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual += F.linear(x, weight)`` as one GEMM with the add in its epilogue (``addmm_``, beta =
        1, in place: an out-of-place addmm first copies ``residual`` to its output, one more kernel);
        the sum is rounded once, where the two ops round the product first. On the library ``tune``
        measured faster for ``F.linear`` at this weight shape and row count. Returns ``residual``."""
        if self._uses_cublaslt(x, weight):
            with blas_library("cublaslt"):
                return residual.addmm_(x, weight.t())
        return residual.addmm_(x, weight.t())

    def _uses_cublaslt(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return (bool(self._cublaslt) and x.dim() == 2
                and (weight.shape[0], weight.shape[1], x.shape[0]) in self._cublaslt and x.is_cuda)

    def choices(self) -> frozenset[tuple[int, int, int]]:
        """The ``(N, K, rows)`` calls that go to cuBLASLt."""
        return frozenset(self._cublaslt)

    def set_choices(self, keys: Iterable[tuple[int, int, int]]) -> None:
        """Replace the table (tests, or choices measured elsewhere)."""
        self._cublaslt.clear()
        self._cublaslt.update((int(n), int(k), int(m)) for n, k, m in keys)

    def tune(
        self,
        weights: Iterable[torch.Tensor],
        rows: Iterable[int],
        skip: Callable[[torch.Tensor, torch.Tensor], bool] | None = None,
    ) -> dict:
        """Time cuBLAS against cuBLASLt for every weight shape among ``weights`` (CUDA, 2-D) at every
        row count in ``rows`` and record where cuBLASLt wins. All weights of one shape are run in turn
        (a model's layers: distinct memory, so each GEMM streams its weight from HBM as in a step).
        ``skip(x, weight)``, if given, leaves out calls that never reach cuBLAS (e.g. the Triton GEMV).
        Returns a summary for the log. No-op where the default library is already cuBLASLt."""
        t0 = time.perf_counter()
        groups: dict[tuple[int, int, torch.dtype], list[torch.Tensor]] = {}
        for w in weights:
            if w.is_cuda and w.dim() == 2:
                groups.setdefault((w.shape[0], w.shape[1], w.dtype), []).append(w)
        measured = chosen = 0
        if not groups or str(torch.backends.cuda.preferred_blas_library()).lower().endswith("cublaslt"):
            return {"measured": 0, "cublaslt": 0, "seconds": 0.0}
        for (n, k, dtype), ws in groups.items():
            device = ws[0].device
            for m in sorted(set(rows)):
                x = torch.randn(m, k, device=device, dtype=dtype)
                if skip is not None and skip(x, ws[0]):
                    continue
                t_default, t_lt = _time_pair(x, ws)
                measured += 1
                key = (n, k, m)
                if t_lt < (1.0 - self.margin) * t_default:
                    self._cublaslt.add(key)
                    chosen += 1
                else:
                    self._cublaslt.discard(key)
        return {"measured": measured, "cublaslt": chosen, "seconds": time.perf_counter() - t0}


@contextlib.contextmanager
def blas_library(name: str) -> Iterator[None]:
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


def _time_pair(x: torch.Tensor, ws: list[torch.Tensor]) -> tuple[float, float]:
    """Milliseconds of one pass of ``F.linear(x, w)`` over ``ws`` on the default library and on
    cuBLASLt (minimum of ``_REPS`` interleaved passes each), measured with CUDA events."""
    for name in ("default", "cublaslt"):  # first calls pick and cache the kernels, outside the timing
        _pass(x, ws[:1], name)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(2 * _REPS + 1)]
    torch.cuda._sleep(_QUEUE_CYCLES)
    events[0].record()
    i = 0
    for _ in range(_REPS):
        for name in ("default", "cublaslt"):
            _pass(x, ws, name)
            i += 1
            events[i].record()
    torch.cuda.synchronize(x.device)
    times = [events[j].elapsed_time(events[j + 1]) for j in range(i)]
    return min(times[0::2]), min(times[1::2])


def _pass(x: torch.Tensor, ws: list[torch.Tensor], name: str) -> None:
    ctx = blas_library("cublaslt") if name == "cublaslt" else contextlib.nullcontext()
    with ctx:
        for w in ws:
            F.linear(x, w)
