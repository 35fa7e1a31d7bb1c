"""Native CPU kernels (C, compiled on first use with the system compiler, called through ctypes).

- ``paged_decode_attention`` reads keys and values in place from the paged cache; the torch path
  has to gather them into a contiguous copy first, which moves every key three times instead of
  once (``csrc/paged_decode_attention.c``).
- ``rms_norm`` (with the residual add), ``silu_and_mul``, ``rotary_embedding`` and
  ``store_kv_cache`` (float32 cache): one pass over memory and one call each, where the torch
  reference takes 2-6 ops (``csrc/elementwise.c``).
- ``gguf_matmul``, ``gguf_dequantize_rows``, ``gguf_dequantize_gather``: GGUF block formats kept
  packed (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, F16, F32 rows), multiplied in place or dequantized
  exactly (``csrc/gguf_matmul.c``); Q4_0 / Q4_1 / Q8_0 also with int8 activations and integer dot
  products, VNNI where the CPU has it, else AVX2 (``csrc/gguf_matmul_q8.c``).

Each takes float32 CPU tensors; ``applies(*tensors)`` says whether a call can go native at all.

Build: ``$CC`` (default ``cc``) with ``FLAGS``: ``-O3 -march=native -fopenmp``, plus reassociation
(``-fassociative-math``, 25-30% faster: the sums vectorize) but not ``-ffast-math``, whose start-up
file would switch the whole process to flush-denormals-to-zero. Built once per source, flags and
CPU (the cache key) into ``$PAGEDLLM_CACHE_DIR`` (default ``~/.cache/pagedllm``); about a second. The
OpenMP runtime it links is the ``libgomp.so.1`` torch has already loaded, so both share one thread
pool. Where there is no compiler, or ``PAGEDLLM_CPU_KERNELS=0``, ``load()`` returns None and the
callers keep the torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from pagedllm import envs

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / "paged_decode_attention.c", CSRC / "elementwise.c", CSRC / "gguf_matmul.c",
           CSRC / "gguf_matmul_q8.c"]
HEADERS = [CSRC / "vec_math.h"]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-shared",
         "-fPIC", "-std=gnu11"]


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _cache_dir() -> Path:
    return envs.PAGEDLLM_CACHE_DIR / "cpu_kernels"


def _build(compiler: str, flags: tuple[str, ...] = ()) -> Path:
    """The library compiled with ``FLAGS`` plus ``flags`` (tests build other instruction sets)."""
    flags = [*FLAGS, *flags]
    source = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    key = hashlib.sha256(source + " ".join([compiler, *flags, _cpu_signature()]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"pagedllm_cpu-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Compile to a private name, then rename: concurrent builders (test workers) never see half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, f"-I{CSRC}", *map(str, SOURCES), "-o", tmp], check=True,
                       capture_output=True, text=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernels, or None (with one warning saying why) where they cannot be built."""
    if not envs.PAGEDLLM_CPU_KERNELS:
        return None
    compiler = shutil.which(envs.CC)
    if compiler is None:
        logger.warning("no C compiler found: the CPU path uses torch ops only (slower decode attention)")
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        logger.warning("building the CPU kernels failed, using the torch path: %s", detail.strip()[-2000:])
        return None
    i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    lib.paged_decode_attention.restype = ctypes.c_int
    lib.paged_decode_attention.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64,
                                           i64, f32, i32]
    lib.rms_norm.restype = None
    lib.rms_norm.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, i64, f32, i32]
    lib.silu_and_mul.restype = None
    lib.silu_and_mul.argtypes = [ptr, ptr, i64, i64, i32]
    lib.rotary_embedding.restype = ctypes.c_int
    lib.rotary_embedding.argtypes = [ptr, i64, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i32]
    lib.store_kv_f32.restype = ctypes.c_int
    lib.store_kv_f32.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, ptr, i64, i64]
    lib.gguf_dequantize_rows.restype = ctypes.c_int
    lib.gguf_dequantize_rows.argtypes = [i32, ptr, i64, i64, i64, ptr, i32]
    lib.gguf_dequantize_gather.restype = ctypes.c_int
    lib.gguf_dequantize_gather.argtypes = [i32, ptr, i64, ptr, i64, i64, ptr, i32]
    lib.gguf_matmul.restype = ctypes.c_int
    lib.gguf_matmul.argtypes = [i32, ptr, i64, i64, i64, ptr, i64, i64, ptr, i64, i32]
    lib.gguf_matmul_q8.restype = ctypes.c_int
    lib.gguf_matmul_q8.argtypes = [i32, ptr, i64, i64, i64, ptr, i64, i64, ptr, i64, i32]
    lib.gguf_q8_supported.restype = ctypes.c_int
    lib.gguf_q8_supported.argtypes = [i32]
    lib.gguf_q8_isa.restype = ctypes.c_int
    lib.gguf_q8_isa.argtypes = []
    return lib


def applies(*tensors: torch.Tensor) -> bool:
    """Whether these tensors can go to the native kernels: float32, on the CPU, unit inner stride,
    and the library built. (Inference only: the kernels record nothing for autograd.) Called for
    every op of every layer on the CPU: a plain loop over cheap attributes (``is_cpu``, not
    ``device.type``, which builds a device object)."""
    for t in tensors:
        if t.dtype is not torch.float32 or not t.is_cpu or t.stride(-1) != 1:
            return False
    return load() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``RMSNorm`` over the last dim of 2-D ``x`` (rows may be strided); with ``residual`` (contiguous,
    ``x``'s shape) first ``s = x + residual``, returning ``(normed, s)``. Preconditions: ``applies``."""
    rows, dim = x.shape
    out = torch.empty((rows, dim), dtype=x.dtype)
    res_out = torch.empty((rows, dim), dtype=x.dtype) if residual is not None else None
    if residual is not None:
        residual = residual.contiguous()
    weight = weight.contiguous()
    load().rms_norm(x.data_ptr(), x.stride(0), residual.data_ptr() if residual is not None else None,
                    weight.data_ptr(), out.data_ptr(), res_out.data_ptr() if res_out is not None else None, rows,
                    dim, float(eps), torch.get_num_threads())
    return out if residual is None else (out, res_out)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` for contiguous ``x`` ``[rows, 2I]``. Preconditions: ``applies``."""
    x = x.contiguous()
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, inter), dtype=x.dtype)
    load().silu_and_mul(x.data_ptr(), out.data_ptr(), rows, inter, torch.get_num_threads())
    return out


def rotary_embedding(x: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
                     sin_cache: torch.Tensor) -> torch.Tensor:
    """NeoX rotary embedding of ``x`` ``[T, heads, head_dim]`` (strided tokens and heads are fine) at
    int64 ``positions`` ``[T]``, with float32 ``[max_pos, rotary_dim // 2]`` caches; returns a new
    contiguous tensor (dims past ``rotary_dim`` copied). Preconditions: ``applies``; a position outside
    the tables raises IndexError (as indexing the tables would)."""
    tokens, heads, head_dim = x.shape
    out = torch.empty((tokens, heads, head_dim), dtype=x.dtype)
    if positions.dtype != torch.int64 or not positions.is_contiguous():
        positions = positions.to(torch.int64).contiguous()
    cos_cache, sin_cache = cos_cache.contiguous(), sin_cache.contiguous()
    if load().rotary_embedding(x.data_ptr(), x.stride(0), x.stride(1), out.data_ptr(), positions.data_ptr(),
                               cos_cache.data_ptr(), sin_cache.data_ptr(), cos_cache.shape[0], tokens, heads,
                               head_dim, 2 * cos_cache.shape[-1], torch.get_num_threads()):
        raise IndexError(f"positions must lie in [0, {cos_cache.shape[0]}) (the rotary table's length)")
    return out


def store_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Row ``t`` of ``key`` / ``value`` (float32 ``[T, num_kv_heads, head_dim]``, strided tokens, each
    token's heads contiguous) into slot ``slots[t]`` (int64) of the float32 ``kv_cache`` ``[2,
    num_blocks, block_size, num_kv_heads, head_dim]``; slots < 0 (padding) are skipped, a slot past
    the cache raises IndexError. The torch reference (``attention.torch_ref.store_kv_cache``): two
    ``index_copy_`` plus a check for padding: about 4x the time of this one call at a decode row."""
    tokens, heads, head_dim = key.shape[0], kv_cache.shape[-2], kv_cache.shape[-1]
    for name, t in (("key", key), ("value", value)):  # shapes and strides only: indexing makes tensors
        if (t.dtype != torch.float32 or t.shape != (tokens, heads, head_dim) or t.stride(2) != 1
                or t.stride(1) != head_dim):
            raise ValueError(f"{name} must be float32 [{tokens}, {heads}, {head_dim}] with each token's heads "
                             f"contiguous, got {t.dtype} {tuple(t.shape)} strides {t.stride()}")
    if kv_cache.dtype != torch.float32 or not kv_cache.is_contiguous() or slots.dtype != torch.int64:
        raise ValueError("kv_cache must be contiguous float32 and slots int64")
    if slots.shape != (tokens,):
        raise ValueError(f"slots must hold one slot per token ({tokens}), got {tuple(slots.shape)}")
    slots = slots.contiguous()
    half = kv_cache.stride(0)  # the values' offset in the cache, in elements
    if load().store_kv_f32(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0), slots.data_ptr(), tokens,
                           kv_cache.data_ptr(), kv_cache.data_ptr() + 4 * half, half // (heads * head_dim),
                           heads * head_dim):
        raise IndexError(f"slots must lie below {half // (heads * head_dim)} (the cache's slots)")


_DECODE_CACHE_DTYPES = (torch.float32, torch.float8_e4m3fn, torch.float8_e5m2)


@functools.cache
def _byte_values(dtype: torch.dtype) -> torch.Tensor:
    """float32 ``[256]``: the value of each byte as a ``dtype`` (a float8) number."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()


def decode_applies(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether ``paged_decode_attention`` takes this query and cache (``applies``, with a float8 cache too)."""
    return kv_cache.dtype in _DECODE_CACHE_DTYPES and kv_cache.device.type == "cpu" and applies(query)


def paged_decode_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, block_tables: torch.Tensor,
    query_rows: torch.Tensor, table_rows: torch.Tensor, seq_lens: torch.Tensor, scale: float,
) -> None:
    """Single-token attention for the decode requests, written into ``out`` at their query rows.

    ``query``/``out``: float32 ``[T, num_heads, head_dim]`` contiguous; ``kv_cache``: float32, float8_e4m3fn
    or float8_e5m2 ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` contiguous (float8 is upcast
    in the kernel, through a table of the 256 byte values); ``block_tables``: int32
    ``[num_reqs, max_blocks]`` with unit inner stride; ``query_rows``/``table_rows``/``seq_lens``:
    int64, one entry per decode request (its query row, its block-table row, its context length).
    Cost: reads each context key and value once; rows not listed are left untouched."""
    lib = load()
    if lib is None:
        raise RuntimeError("the CPU kernels are not available (see the warning logged by native.kernels.load)")
    if kv_cache.dtype not in _DECODE_CACHE_DTYPES or kv_cache.device.type != "cpu":
        raise ValueError(f"kv_cache must be a CPU float32 or float8 tensor, got {kv_cache.dtype} on {kv_cache.device}")
    for name, t, dtype in (("query", query, torch.float32), ("out", out, torch.float32),
                           ("block_tables", block_tables, torch.int32),
                           ("query_rows", query_rows, torch.int64), ("table_rows", table_rows, torch.int64),
                           ("seq_lens", seq_lens, torch.int64)):
        if t.dtype != dtype or not t.is_cpu:
            raise ValueError(f"{name} must be a CPU {dtype} tensor, got {t.dtype} on {t.device}")
    if not (query.is_contiguous() and out.is_contiguous() and kv_cache.is_contiguous()):
        raise ValueError("query, out and kv_cache must be contiguous")
    if block_tables.stride(-1) != 1:
        raise ValueError("block_tables must have a unit inner stride")
    n = query_rows.shape[0]
    if table_rows.shape[0] != n or seq_lens.shape[0] != n:
        raise ValueError("query_rows, table_rows and seq_lens must have one entry per decode request")
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_heads = query.shape[1]
    if num_heads % num_kv_heads or query.shape[2] != head_dim:
        raise ValueError(f"query heads {tuple(query.shape[1:])} do not fit the cache's {num_kv_heads} KV heads x {head_dim}")
    lut = _byte_values(kv_cache.dtype) if kv_cache.dtype != torch.float32 else None
    rc = lib.paged_decode_attention(
        query.data_ptr(), kv_cache.data_ptr(), lut.data_ptr() if lut is not None else None, out.data_ptr(), block_tables.data_ptr(), block_tables.stride(0),
        query_rows.data_ptr(), table_rows.data_ptr(), seq_lens.data_ptr(), n,
        num_blocks, block_size, num_heads, num_kv_heads, head_dim, float(scale), torch.get_num_threads())
    if rc != 0:
        raise MemoryError("paged_decode_attention could not allocate its scratch buffers")


# GGML type -> (weights, bytes) of one block, for the types csrc/gguf_matmul.c knows.
GGUF_BLOCK_SHAPES = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 8: (32, 34), 12: (256, 144), 13: (256, 176),
                     14: (256, 210)}


def _gguf_check(packed: torch.Tensor, qtype: int, k: int) -> int:
    """Row stride in bytes of a packed GGUF matrix ``[rows, row_bytes]`` of ``k`` weights a row
    (ValueError for an unknown type, a bad shape or a non-contiguous tensor)."""
    if load() is None:
        raise RuntimeError("the CPU kernels are not available (see the warning logged by native.kernels.load)")
    shape = GGUF_BLOCK_SHAPES.get(qtype)
    if shape is None:
        raise ValueError(f"GGUF type {qtype} has no CPU kernel")
    if packed.dtype != torch.uint8 or packed.device.type != "cpu" or packed.dim() != 2 or not packed.is_contiguous():
        raise ValueError("packed must be a contiguous CPU uint8 tensor [rows, row_bytes]")
    if k % shape[0] or packed.shape[1] != k // shape[0] * shape[1]:
        raise ValueError(f"packed rows of {packed.shape[1]} bytes do not hold {k} weights of GGUF type {qtype}")
    return packed.shape[1]


def gguf_dequantize_rows(packed: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """Float32 ``[rows, k]``: the rows of a packed GGUF matrix, equal to ``gguf.quants.dequantize``
    bit for bit."""
    row_bytes = _gguf_check(packed, qtype, k)
    out = torch.empty((packed.shape[0], k), dtype=torch.float32)
    load().gguf_dequantize_rows(qtype, packed.data_ptr(), row_bytes, packed.shape[0], k, out.data_ptr(),
                                torch.get_num_threads())
    return out


def gguf_dequantize_gather(packed: torch.Tensor, qtype: int, k: int, ids: torch.Tensor) -> torch.Tensor:
    """Float32 ``[len(ids), k]``: rows ``ids`` of a packed GGUF matrix, dequantized (an embedding
    lookup). An id outside the rows raises IndexError."""
    row_bytes = _gguf_check(packed, qtype, k)
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < packed.shape[0]):
        raise IndexError(f"ids must lie in [0, {packed.shape[0]})")
    out = torch.empty((ids.numel(), k), dtype=torch.float32)
    load().gguf_dequantize_gather(qtype, packed.data_ptr(), row_bytes, ids.data_ptr(), ids.numel(), k,
                                  out.data_ptr(), torch.get_num_threads())
    return out


def gguf_matmul_segments(x: torch.Tensor, segments: tuple[tuple[int, torch.Tensor, int], ...],
                         out: torch.Tensor) -> None:
    """``gguf_matmul`` of each ``(qtype, packed, first_column)`` segment of one layer into ``out[:,
    first_column:first_column + N]``, with float activations: the decode path of a packed layer,
    one C call per segment and no per-call checks but the row size (the layer checked the
    segments' types and shapes once, at load). ``x`` float32 ``[M, K]``, ``out`` float32 ``[M,
    >= last column]``, both with a unit inner stride (the caller's precondition); a packed row
    that does not hold ``K`` weights raises ValueError."""
    lib, threads = load(), torch.get_num_threads()
    m, k = x.shape
    x_ptr, ldx, out_ptr, ldy = x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0)
    for qtype, packed, first_column in segments:
        elems, nbytes = GGUF_BLOCK_SHAPES[qtype]
        row_bytes = packed.shape[1]
        if row_bytes * elems != k * nbytes:
            raise ValueError(f"packed rows of {row_bytes} bytes do not hold {k} weights of GGUF type {qtype}")
        if lib.gguf_matmul(qtype, packed.data_ptr(), row_bytes, packed.shape[0], k, x_ptr, ldx, m,
                           out_ptr + 4 * first_column, ldy, threads):
            raise MemoryError("gguf_matmul could not allocate its scratch buffer")


def gguf_q8_supported(qtype: int) -> bool:
    """Whether ``gguf_matmul(..., int8_activations=True)`` has an integer kernel for ``qtype`` on this
    CPU (Q4_0, Q4_1, Q8_0 with AVX2, F16C and FMA; VNNI where present)."""
    lib = load()
    return lib is not None and bool(lib.gguf_q8_supported(qtype))


def gguf_matmul(x: torch.Tensor, packed: torch.Tensor, qtype: int, out: torch.Tensor,
                int8_activations: bool = False) -> torch.Tensor:
    """``out[:, :N] = x @ W^T`` for float32 ``x [M, K]`` (unit inner stride) and a packed GGUF ``W [N,
    K]``; ``out`` float32 ``[M, >= N]`` with unit inner stride (a column slice of a wider output is
    fine: merged layers with shards of different types). Cost: reads W once; M rows share each
    decoded block (4 at a time with float activations, 8 with int8 ones).

    ``int8_activations``: quantize each 32-value block of ``x`` to int8 with one scale (llama.cpp's
    Q8 scheme) and take integer dot products (``csrc/gguf_matmul_q8.c``): 2-4x faster, and the
    result differs from the float product by the activations' rounding (about 1e-3 of the row's
    scale). Only where ``gguf_q8_supported(qtype)``; else ValueError."""
    m, k = x.shape
    row_bytes = _gguf_check(packed, qtype, k)
    n = packed.shape[0]
    if x.dtype != torch.float32 or out.dtype != torch.float32 or x.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("x and out must be float32 with a unit inner stride")
    if out.shape[0] != m or out.shape[1] < n:
        raise ValueError(f"out {tuple(out.shape)} cannot hold [{m}, {n}]")
    if int8_activations and not gguf_q8_supported(qtype):
        raise ValueError(f"int8_activations: GGUF type {qtype} has no int8 kernel on this CPU")
    kernel = load().gguf_matmul_q8 if int8_activations else load().gguf_matmul
    rc = kernel(qtype, packed.data_ptr(), row_bytes, n, k, x.data_ptr(), x.stride(0), m, out.data_ptr(),
                out.stride(0), torch.get_num_threads())
    if rc != 0:
        raise MemoryError("gguf_matmul could not allocate its scratch buffer")
    return out
