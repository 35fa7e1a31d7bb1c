"""``y = x W^T (+ b)`` at a few rows for FP8 weights, weight-only (W8A16): ``W [N, K]``
float8_e4m3fn with a float32 scale per output row (``W ~= Wq * scale[:, None]``), ``x`` in bf16 /
fp16 / fp32 as it is (no activation quantization), float32 sums, one rounding to x's dtype.

At decode (1 to ``GEMV_MAX_ROWS`` rows) a linear layer is a read of W. cuBLASLt's FP8 GEMM picks
tiles for large M and needs the activations quantized first (a few small launches a layer); here
one kernel reads each weight byte once and leaves x in its dtype:

- ``_fp8_gemv_kernel``: a program owns ``BLOCK_N`` output rows and one split of K; it streams
  their ``[BLOCK_N, BLOCK_K]`` chunks of W (contiguous along K: 16-byte loads) and multiplies them
  with the chunk's ``[BLOCK_M, BLOCK_K]`` inputs either on the CUDA cores (``DOT`` off, one row:
  the codes converted to float32, a float32 sum per element, reduced once at the end) or on the
  tensor cores (``DOT`` on, 2 to ``GEMV_MAX_ROWS`` rows: the codes converted to x's dtype, exact
  for bf16 and fp16, and ``tl.dot`` on at least 16 rows). The row scale multiplies the sums once.
  Measured on an H100 (``benchmarks/gpu/fp8_decode_bench.py``, Llama-3.1-8B shapes): at one row
  2.5-2.9 TB/s of weights (copy: 3.0), 0.47-0.61x bf16 ``F.linear`` and 0.32-0.87x the
  act-quant + cuBLASLt path; at 4 rows the CUDA-core form fell to 0.6-0.8 TB/s while the tensor
  cores kept 1.7-2.0; up to 32 rows the GEMV beats cuBLASLt's FP8 GEMM summed over the four
  projections, at 64 rows it takes 1.7x as long (``GEMV_MAX_ROWS``). Decoding the codes as int32
  words by integer ops instead of conversion instructions measured no faster.
- Prologues (``rms_norm_fp8_gemv``, ``silu_and_mul_fp8_gemv``; in the CUDA-core form): the op
  before the projection computes the input chunk on the fly, as ``layers/kernels/fused_gemv.py``
  does for float weights: residual add + RMSNorm in one pass (each program accumulates the
  squares of its chunks and scales its sums by ``rstd`` at the end; program 0 writes the new
  residual; K not split), or SiLU-and-mul of ``[gate | up]``. One launch instead of two.
- Split K (``SPLIT_K``, where the row blocks alone leave SMs idle: narrow layers such as o_proj
  and down_proj): each split writes its float32 partial sums to ``[SPLIT, M, N]`` and
  ``splitk.splitk_sum_kernel`` adds them with the bias, in x's dtype.

With PDL (``pagedllm/pdl.py``: the batch-1 decode graph) each program waits for the kernel that
wrote x before its loop and lets the next kernel launch after it, as the bf16 GEMVs do.

Launch sizes are a function of the shape (``gemv_config``), never timed at call time: a CUDA graph
captures the launches as they are. The only allocations are the output and the split-K partial
sums (the caching allocator's: capturable). Requirements (``fits``): a 2-D float input with
contiguous rows, a contiguous ``[N, K]`` float8_e4m3fn weight, ``[N]`` scales.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from pagedllm.layers.kernels.fused_gemv import _silu_mul_chunk
from pagedllm.layers.kernels.rms_norm import _load_sum
from pagedllm.pdl import launch_kwargs
from pagedllm.quantization.kernels.splitk import splitk_sum_kernel
from pagedllm.triton_pdl import allow_dependents, wait_for_inputs

# At most this many rows take the GEMV; more rows the caller's GEMM (cuBLASLt FP8 on Hopper).
GEMV_MAX_ROWS = 32
# K is split until there are this many programs per SM (or the splits would be shorter than a chunk).
PROGRAMS_PER_SM = 2
# The CUDA-core form loads the next weight chunk before multiplying the current one (module doc):
# off by default until the H100 figures say otherwise (benchmarks/gpu/fp8_decode_bench.py).
PREFETCH = False
# The one-row CUDA-core form sums each chunk's products per output row at once (a [BLOCK_N] float32
# accumulator, as the bf16 GEMVs do) instead of per element (a [BLOCK_N, BLOCK_K] one, reduced at the
# end): fewer registers, so larger chunks (module doc).
CHUNK_SUMS = False


# What runs in the GEMV's prologue (``PROLOGUE``): nothing, residual add + RMSNorm, SiLU-and-mul.
NO_PROLOGUE, NORM_PROLOGUE, ACT_PROLOGUE = 0, 1, 2


@triton.jit
def _input_chunk(x_rows, res_rows, res_out_rows, g_ptr, cols, mask, store_mask, K, ss,
                 PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """The GEMV's input chunk at columns ``cols`` (``x_rows`` and the masks carry the row axis in
    front of ``cols``' shape) and the running sum of squares ``ss``: ``x`` as it is; or ``(x +
    residual) * g`` in float32 (never rounded; the sum rounded to x's dtype and stored to
    ``res_out`` under ``store_mask``), its squares added to ``ss``; or ``silu(gate) * up`` rounded as
    the torch path rounds it (gate = columns ``[0, K)``, up ``[K, 2K)``)."""
    if PROLOGUE == 1:
        s = _load_sum(x_rows, res_rows, res_out_rows, cols, mask, store_mask, HAS_RESIDUAL, True)
        ss += s * s
        x = s * tl.load(g_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
    elif PROLOGUE == 2:
        x = _silu_mul_chunk(x_rows, cols, mask, K)
    else:
        x = tl.load(x_rows + cols, mask=mask, other=0.0)
    return x, ss


@triton.jit
def _weight_chunk(w_rows, n_mask, rk, k_stop):
    """The ``[BLOCK_N, BLOCK_K]`` codes of ``w_rows`` at columns ``rk`` (zeros at and past ``k_stop``),
    streamed (evict first: each byte is read once)."""
    return tl.load(w_rows + rk[None, :], mask=n_mask[:, None] & (rk < k_stop)[None, :], other=0.0,
                   eviction_policy="evict_first")


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, res_ptr, res_out_ptr, g_ptr, M, N, K, K_PER_SPLIT,
                     eps, stride_xm, stride_wn, stride_om, stride_rm, stride_rom, HAS_BIAS: tl.constexpr,
                     SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     DOT: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                     USE_PDL: tl.constexpr, PREFETCH: tl.constexpr, CHUNK_SUMS: tl.constexpr):
    """Rows ``rn`` of the output over one split of K (module doc). ``BLOCK_M`` >= M (a power of two;
    at least 16 with ``DOT``). With the norm prologue (no split) program 0 writes the new residual
    and the sums are scaled by each row's ``rstd`` at the end."""
    pid_k = tl.program_id(1)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    rm = tl.arange(0, BLOCK_M)
    m_mask = rm < M
    # Program 0's rows write the new residual (a full-shaped mask: the interpreter takes no scalar one).
    store_rows = m_mask & (rm * 0 + tl.program_id(0) == 0)
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + rm[:, None] * stride_xm
    res_rows = res_ptr + rm[:, None] * stride_rm
    res_out_rows = res_out_ptr + rm[:, None] * stride_rom
    k_begin = pid_k * K_PER_SPLIT
    wait_for_inputs(USE_PDL)
    ss = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
    if not DOT and BLOCK_M == 1 and not CHUNK_SUMS:
        acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    k_stop = tl.minimum(K, k_begin + K_PER_SPLIT)
    if PREFETCH:
        w_next = _weight_chunk(w_rows, n_mask, k_begin + tl.arange(0, BLOCK_K), k_stop)
    for k0 in range(k_begin, k_begin + K_PER_SPLIT, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_mask = rk < K
        if PREFETCH:  # this chunk came with the last iteration; ask for the next one now
            w = w_next
            w_next = _weight_chunk(w_rows, n_mask, rk + BLOCK_K, k_stop)
        else:
            w = _weight_chunk(w_rows, n_mask, rk, k_stop)
        x, ss = _input_chunk(x_rows, res_rows, res_out_rows, g_ptr, rk[None, :], m_mask[:, None] & k_mask[None, :],
                             store_rows[:, None] & k_mask[None, :], K, ss, PROLOGUE, HAS_RESIDUAL)
        if DOT:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
        elif BLOCK_M == 1 and not CHUNK_SUMS:
            acc += w.to(tl.float32) * x.to(tl.float32)
        else:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    allow_dependents(USE_PDL)
    if not DOT and BLOCK_M == 1 and not CHUNK_SUMS:
        y = tl.sum(acc, axis=1)[None, :]
    else:
        y = acc
    y = y * tl.load(s_ptr + rn, mask=n_mask, other=0.0)[None, :]
    if PROLOGUE == 1:
        y = y * tl.math.rsqrt(tl.sum(ss, axis=1) / K + eps)[:, None]
    if SPLIT_K:  # float32 partial sums into this split's [M, N] slice
        out = out_ptr + pid_k * M * N
        stride = N
    else:
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out = out_ptr
        stride = stride_om
    tl.store(out + rm[:, None] * stride + rn[None, :], y.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@functools.cache
def num_sms(device_index: int) -> int:
    """The SM count of CUDA device ``device_index`` (cached)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device_sms(x: torch.Tensor) -> int:
    if not x.is_cuda:
        return 132  # under the interpreter: an H100's
    return num_sms(x.device.index if x.device.index is not None else torch.cuda.current_device())


def gemv_config(m: int, n: int, k: int, sm_count: int) -> tuple[int, int, int, bool, int]:
    """``(block_n, block_k, num_warps, dot, split)`` for ``m`` rows and an ``[n, k]`` weight, the
    fastest measured (module doc): at one row 8 weight rows x 1024 columns a chunk (8 KiB of codes in
    flight per program) on the CUDA cores; at 2-4 rows 32 x 256 on the tensor cores; above, 64 x
    256. K is split (in whole chunks) until there are ``PROGRAMS_PER_SM`` programs per SM."""
    if m == 1:
        block_n, block_k, num_warps, dot = 8, 1024, 4, False
    elif m <= 4:
        block_n, block_k, num_warps, dot = 32, 256, 4, True
    else:
        block_n, block_k, num_warps, dot = 64, 256, 4, True
    block_k = min(block_k, triton.next_power_of_2(k))
    return block_n, block_k, num_warps, dot, split_k(n, k, block_n, block_k, sm_count)


def split_k(n: int, k: int, block_n: int, block_k: int, sm_count: int) -> int:
    """The splits of K for ``block_n x block_k`` chunks: doubled from 1 until there are
    ``PROGRAMS_PER_SM`` programs per SM or as many splits as chunks."""
    chunks = triton.cdiv(k, block_k)
    programs = triton.cdiv(n, block_n)
    split = 1
    while split < chunks and programs * split < PROGRAMS_PER_SM * sm_count:
        split *= 2
    return min(split, chunks)


def fits(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, prologue: int = NO_PROLOGUE) -> bool:
    """Whether the kernel takes ``x`` (``[M, K]``; ``[M, 2K]`` with the activation prologue) times
    ``Wq^T`` (module doc)."""
    k = wq.shape[1] * (2 if prologue == ACT_PROLOGUE else 1) if wq.dim() == 2 else -1
    return (x.dim() == 2 and x.stride(-1) == 1 and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and wq.dim() == 2 and wq.is_contiguous() and wq.dtype == torch.float8_e4m3fn
            and x.shape[1] == k and w_scale.numel() == wq.shape[0] and w_scale.is_contiguous())


def prologue_fits(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, prologue: int) -> bool:
    """Whether a prologue runs in the GEMV at ``x``'s rows: the CUDA-core form (one row, by
    ``gemv_config``) and, for the norm (which needs the whole row in one program), no split of K."""
    if not fits(x, wq, w_scale, prologue):
        return False
    n, k = wq.shape
    _, _, _, dot, split = gemv_config(x.shape[0], n, k, _device_sms(x))
    return not dot and (prologue != NORM_PROLOGUE or split == 1)


def _launch(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
            config: tuple[int, int, int, bool, int] | None, prologue: int = NO_PROLOGUE,
            norm: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, float] | None = None) -> torch.Tensor:
    """The GEMV (+ split-K sum) into a new ``[M, N]`` tensor; ``norm``: ``(residual, residual_out,
    norm weight, eps)`` of the norm prologue."""
    m = x.shape[0]
    n, k = wq.shape
    block_n, block_k, num_warps, dot, split = config or gemv_config(m, n, k, _device_sms(x))
    if prologue != NO_PROLOGUE and (dot or (prologue == NORM_PROLOGUE and split > 1)):
        raise ValueError(f"fp8 GEMV config {config}: a prologue needs the CUDA-core form (and no split for the norm)")
    block_m = max(16 if dot else 1, triton.next_power_of_2(m))
    k_per_split = triton.cdiv(triton.cdiv(k, block_k), split) * block_k
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    target = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    b = bias if bias is not None else w_scale
    residual, residual_out, g, eps = norm if norm is not None else (None, x, w_scale, 0.0)
    res = residual if residual is not None else x
    _fp8_gemv_kernel[(triton.cdiv(n, block_n), split)](
        x, wq, w_scale, b, target, res, residual_out, g, m, n, k, k_per_split, eps, x.stride(0), wq.stride(0),
        out.stride(0), res.stride(0), residual_out.stride(0), HAS_BIAS=bias is not None, SPLIT_K=split > 1,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT=dot, PROLOGUE=prologue,
        HAS_RESIDUAL=residual is not None, PREFETCH=PREFETCH and not dot, CHUNK_SUMS=CHUNK_SUMS, num_warps=num_warps,
        **launch_kwargs(x.device))
    if split > 1:
        block = 1024
        splitk_sum_kernel[(triton.cdiv(m * n, block),)](target, b, out, m, n, out.stride(0), SPLIT=split,
                                                         HAS_BIAS=bias is not None, BLOCK=block, num_warps=4,
                                                         **launch_kwargs(x.device))
    return out


def fp8_gemv(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
             config: tuple[int, int, int, bool, int] | None = None) -> torch.Tensor:
    """``[M, N]`` in x's dtype: ``x @ (Wq * w_scale[:, None])^T (+ bias)``; ``config`` as
    ``gemv_config`` returns (its default for the shape). Precondition: ``fits``; any M works (the
    engine takes it up to ``GEMV_MAX_ROWS``). With ``dot`` a float32 ``x`` runs the tensor cores in
    tf32 (float32 tests use the CUDA-core form)."""
    return _launch(x, wq, w_scale, bias, config)


def rms_norm_fp8_gemv(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                      wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
                      config: tuple[int, int, int, bool, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8_gemv(rmsnorm(x + residual) * g), x + residual)`` in one launch, as
    ``layers/kernels/fused_gemv.rms_norm_linear`` computes it for a float weight (the normed row never
    rounded); without a residual ``(fp8_gemv(rmsnorm(x) * g), x)``. Precondition: ``prologue_fits``
    (``NORM_PROLOGUE``), ``residual`` like ``x``, ``norm_weight`` ``[K]`` contiguous."""
    residual_out = torch.empty_like(x) if residual is not None else x
    y = _launch(x, wq, w_scale, bias, config, NORM_PROLOGUE, (residual, residual_out, norm_weight, eps))
    return y, residual_out


def silu_and_mul_fp8_gemv(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None,
                          config: tuple[int, int, int, bool, int] | None = None) -> torch.Tensor:
    """``fp8_gemv(silu(gate) * up)`` for ``x = [gate | up]`` ``[M, 2K]`` in one launch (the activation
    rounded as ``SiluAndMul`` rounds it). Precondition: ``prologue_fits`` (``ACT_PROLOGUE``)."""
    return _launch(x, wq, w_scale, bias, config, ACT_PROLOGUE)
