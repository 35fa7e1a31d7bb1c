"""The int4 dequantize-in-the-GEMM Triton kernels (GPTQ / AWQ serving form) against the torch
reference that dequantizes: under Triton's interpreter in CI (small shapes, a subprocess with
``TRITON_INTERPRET=1``), and on CUDA (``gpu``: real shapes, a captured CUDA graph, a whole model)."""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from pagedllm.quantization import int4

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_cuda = pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs Triton and CUDA")

# (rows M, outputs N, inputs K, group size, act-order perm, bias, dtype[, launch config]), the row
# layout: GEMV (M <= 4; word tiles at one row) and dequantize + matmul, groups of 8, 32, 128 and one
# group (-1), ragged N and K tails.
INTERPRETER_CASES = [
    (1, 48, 64, 32, False, True, torch.float32),
    (1, 40, 136, 8, True, False, torch.float16),
    (1, 48, 64, 32, True, True, torch.float32, (16, 32, 4, False)),  # the strided GEMV at one row
    (2, 40, 128, -1, True, False, torch.float16),
    (3, 24, 72, 8, False, True, torch.float32),
    (5, 72, 96, 32, True, True, torch.float32),
    (17, 64, 256, 128, False, False, torch.float16),
    (9, 24, 64, 8, True, False, torch.float32),
]
# The word-row layout (K a multiple of 128): its GEMV at 1-4 rows (a program per row), runs of 4
# to 32 words, split K (partial sums + the reduce kernel), groups
# of 8 to one, act-order; more rows through its dequantize kernel.
N8_INTERPRETER_CASES = [
    (1, 16, 256, 128, False, True, torch.float32),
    (1, 24, 512, 128, True, True, torch.bfloat16, (1, 4, 2)),  # 32 threads x 4 words, K split in 2
    (1, 16, 1024, -1, False, False, torch.float32, (2, 8, 2)),
    (2, 16, 256, 32, True, False, torch.float16),
    (3, 8, 384, 8, False, True, torch.float32, (1, 4, 3)),
    (4, 16, 256, 64, True, True, torch.float32),
    (7, 24, 256, 32, True, True, torch.float32),
]
# The word-row GEMV's launch options at one and two rows: two word rows a program, the zero points
# subtracted once a step (``fold_zero``), both; with K split in two.
N8_GEMV_CONFIG_CASES = [
    (1, 32, 512, 128, False, True, torch.float32, (4, 4, 1, 2, False)),
    (2, 32, 1024, 32, True, False, torch.float16, (4, 8, 1, 1, True)),
    (1, 48, 1024, 128, False, True, torch.float16, (2, 8, 2, 2, True)),
    (2, 16, 512, 128, True, True, torch.float32, (4, 4, 1, 1, False, True)),  # all the step's loads at once
    (1, 32, 512, 128, False, True, torch.float32, (4, 4, 1, 2, False, False, True)),  # the sums reduced at once
    (2, 48, 1024, 128, True, False, torch.float16, (2, 8, 2, 1, True, False, True)),
]
# The word-row layout's tiled GEMM (3 to TILED_MAX_ROWS half-precision rows): row tiles of 16 to 64
# and three of them, output tiles of 16 to 64, runs of 8 to 32 words (chunks of one group: 32 to
# 128 columns, one group over K), split K, act-order, bias, launch configs. float16 only: Triton's
# interpreter multiplies bfloat16 dots wrongly (the GPU tests take bfloat16).
TILED_INTERPRETER_CASES = [
    (3, 16, 256, 32, True, False, torch.float16),
    (17, 64, 512, 32, True, True, torch.float16),
    (40, 48, 1024, 128, False, True, torch.float16, (16, 16, 2, 4, 3)),
    (4, 32, 1024, -1, True, True, torch.float16, (16, 16, 4, 4, 3)),
    (3, 16, 2048, 128, False, True, torch.float16),
    (33, 128, 4096, 128, True, False, torch.float16, (32, 64, 1, 4, 3)),
]


@functools.lru_cache(maxsize=1)  # a GPU case reuses its 8B-sized weight for every row count
def make_weight(n: int, k: int, group_size: int, act_order: bool, device, seed: int = 0,
                layout: str = int4.ROWS_LAYOUT):
    """Random serving-form tensors: ``(qweight, scales [N, G], zeros [N, G], perm or None)``, qweight
    in ``layout`` (``[N, K/8]`` or ``[N/8, K]``)."""
    gen = torch.Generator().manual_seed(seed)
    gs = group_size if group_size > 0 else k
    groups = -(-k // gs)
    q = torch.randint(0, 16, (n, k), generator=gen)
    scales = (torch.rand(n, groups, generator=gen) * 0.02 + 0.002).half()
    zeros = torch.randint(0, 16, (n, groups), generator=gen).half()
    perm = torch.randperm(k, generator=gen).to(torch.int32) if act_order else None
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    qweight = int4.pack_n8(q, gs) if layout == int4.N8_LAYOUT else int4.pack_cols(q)
    return to(qweight), to(scales), to(zeros), to(perm)


def check_case(case, device: str, seed: int = 0, layout: str = int4.ROWS_LAYOUT) -> float:
    """Relative max error of the kernel against the reference for one case."""
    from pagedllm.quantization.kernels import int4_gemm

    m, n, k, group_size, act_order, with_bias, dtype, *config = case
    qweight, scales, zeros, perm = make_weight(n, k, group_size, act_order, device, seed, layout)
    gs = group_size if group_size > 0 else k
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    bias = torch.randn(n, generator=gen).to(device, dtype) if with_bias else None
    assert int4_gemm.fits(x, qweight, gs, layout)
    want = int4.int4_linear_reference(x, qweight, scales, zeros, perm, gs, layout)
    if bias is not None:
        want += bias.float()
    got = int4_gemm.int4_linear(x, qweight, scales, zeros, perm, gs, bias, config=config[0] if config else None,
                                layout=layout)
    assert got.dtype == dtype and got.shape == (m, n)
    return float((got.float() - want).abs().max() / want.abs().max())


def _interpreter_main() -> None:
    cases = [(c, int4.ROWS_LAYOUT) for c in INTERPRETER_CASES]
    cases += [(c, int4.N8_LAYOUT) for c in N8_INTERPRETER_CASES + N8_GEMV_CONFIG_CASES + TILED_INTERPRETER_CASES]
    # Folded zero points lose 11 of float32's 24 bits in the step's sums (``_n8_plane``).
    for case, layout in cases:
        err = check_case(case, "cpu", layout=layout)
        tol = {torch.float32: 1e-4 if case[7:] and case[7][4:] == (True,) else 1e-5, torch.float16: 2e-3,
               torch.bfloat16: 1e-2}[case[6]]
        assert err < tol, (case, layout, err)
        print("ok", layout, case, err)


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_kernels_match_the_reference_in_the_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    code = f"import runpy; runpy.run_path({__file__!r})['_interpreter_main']()"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.count("ok") == (len(INTERPRETER_CASES) + len(N8_INTERPRETER_CASES) + len(N8_GEMV_CONFIG_CASES)
                                       + len(TILED_INTERPRETER_CASES))


def test_word_rows_pack_eight_outputs_of_one_input_column():
    """``N8_LAYOUT``: nibble ``j`` of a word of row ``b`` is ``q[8b + j, k]``, the columns stored in
    the GEMV's load order; both layouts dequantize to the same W, and the reference reads either."""
    q = torch.randint(0, 16, (16, 256), generator=torch.Generator().manual_seed(0))
    words = int4.pack_rows(q)
    assert words.shape == (2, 256) and words.dtype == torch.int32
    assert int(words[1, 3]) & 0xF == q[8, 3] and (int(words[1, 3]) >> 28) & 0xF == q[15, 3]
    assert torch.equal(int4.unpack_rows(words), q.int())
    assert int4.n8_run(256, 8) == 8 and int4.n8_run(4096, 128) == 32 and int4.n8_run(14336, 128) == 16
    assert int4.n8_run(136, 8) is None
    order = int4.n8_memory_order(256, 8)  # tiles of 32 threads x 8 columns, 4 columns a load
    assert order[:8].tolist() == [0, 1, 2, 3, 8, 9, 10, 11] and order[128:132].tolist() == [4, 5, 6, 7]
    stored = int4.pack_n8(q, 8)
    assert torch.equal(stored, words[:, order]) and torch.equal(int4.unpack_n8(stored, 8), q.int())
    scales, zeros = torch.rand(16, 32).half(), torch.randint(0, 16, (16, 32)).half()
    rows_form = int4.dequantize(int4.pack_cols(q), scales, zeros, 8)
    torch.testing.assert_close(int4.dequantize(stored, scales, zeros, 8, layout=int4.N8_LAYOUT), rows_form)
    torch.testing.assert_close(int4.dequantize(stored, scales, zeros, 8, slice(8, 16), int4.N8_LAYOUT), rows_form[8:])
    x = torch.randn(3, 256)
    torch.testing.assert_close(int4.int4_linear_reference(x, stored, scales, zeros, None, 8, int4.N8_LAYOUT),
                               x @ rows_form.t())


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_the_layout_is_word_rows_on_cuda_where_the_gemv_takes_the_shape():
    cuda = torch.device("cuda")
    assert int4.choose_layout(cuda, 4096, 128) == int4.N8_LAYOUT
    assert int4.choose_layout(cuda, 14336, 14336) == int4.N8_LAYOUT  # group_size -1
    assert int4.choose_layout(cuda, 136, 8) == int4.ROWS_LAYOUT  # K not a multiple of 128
    assert int4.choose_layout(torch.device("cpu"), 4096, 128) == int4.ROWS_LAYOUT


def test_gemv_config_fills_the_gpu_and_divides_k():
    """Splits K where the word rows alone give too few programs; runs stay inside groups."""
    from pagedllm.quantization.kernels import int4_gemm

    for m, n, k, gs in [(1, 4096, 4096, 128), (1, 4096, 14336, 128), (1, 28672, 4096, 128), (2, 6144, 4096, 128),
                        (4, 4096, 4096, 32), (1, 1024, 256, 8), (3, 4096, 14336, 14336)]:
        num_warps, run, split, word_rows, *_ = int4_gemm.gemv_n8_config(m, n, k, gs, 132)
        assert (n // 8) % word_rows == 0, (m, n, k, gs)
        assert run == int4.n8_run(k, gs) and k % (32 * num_warps * run * split) == 0, (m, n, k, gs)
        steps = k // (32 * num_warps * run)
        assert split == steps or m * n // 8 // word_rows * split >= int4_gemm.N8_PROGRAMS_PER_SM * 132, (m, n, k, gs)


def test_one_row_gemv_defaults_are_the_measured_best(monkeypatch):
    """The 8B shapes at one row (H100 sweep, ``N8_*`` in ``int4_gemm``): zero points folded, two
    warps on gate_up (3584 word rows: 8 programs an SM and more), four elsewhere, one word row a
    program, K unsplit; a float32 input never folds (``int4_gemv_n8``)."""
    from pagedllm.quantization.kernels import int4_gemm

    configs = {(n, k): int4_gemm.gemv_n8_config(1, n, k, 128, 132)
               for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]}
    joint = int4_gemm.N8_JOINT_SUM
    assert configs == {(6144, 4096): (4, 32, 1, 1, True, False, joint), (4096, 4096): (4, 32, 1, 1, True, False, joint),
                       (28672, 4096): (2, 32, 1, 1, True, False, joint),
                       (4096, 14336): (4, 16, 1, 1, True, False, joint)}
    qweight, scales, zeros, _ = make_weight(16, 256, 128, False, "cpu", layout=int4.N8_LAYOUT)
    calls = []

    class _Spy:  # the launch, recorded (no kernel runs)
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append(kwargs["FOLD_ZERO"])

    monkeypatch.setattr(int4_gemm, "_int4_gemv_n8_kernel", _Spy())
    for dtype in (torch.float32, torch.bfloat16):
        int4_gemm.int4_gemv_n8(torch.zeros(1, 256, dtype=dtype), qweight, scales, zeros, None, 128, None)
    assert calls == [False, True]


def test_off_cuda_the_reference_path_runs():
    """CPU tensors never reach the kernels (``int4_linear`` takes the reference path)."""
    qweight, scales, zeros, perm = make_weight(16, 64, 32, True, "cpu")
    x = torch.randn(3, 64)
    want = int4.int4_linear_reference(x, qweight, scales, zeros, perm, 32)
    torch.testing.assert_close(int4.int4_linear(x, qweight, scales, zeros, perm, 32, None), want)


def _assert_no_spills(kernel) -> None:
    """A compiled kernel's registers fit: no local memory, no stack (read from its cubin by
    Triton's bundled cuobjdump, where there is one)."""
    import shutil

    import triton

    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    cuobjdump = shutil.which("cuobjdump") or bundled
    if not os.path.exists(cuobjdump):
        return
    cubin = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"int4_kernel_{os.getpid()}.cubin")
    with open(cubin, "wb") as f:
        f.write(kernel.asm["cubin"])
    usage = subprocess.run([cuobjdump, "-res-usage", cubin], capture_output=True, text=True).stdout
    os.unlink(cubin)
    assert " LOCAL:0 " in usage and "STACK:0 " in usage, usage


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_word_row_gemv_compiles_for_hopper_without_spills():
    """The interpreter does not compile: build the one-row GEMV (and the split-K sum) for sm_90 with
    Triton's own ptxas, no GPU needed, and read its registers: none spilled to local memory."""

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pagedllm.quantization.kernels import int4_gemm

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("Triton without its bundled ptxas")
    target = GPUTarget("cuda", 90, 32)
    ints = ("M", "N", "K", "GROUP_SIZE", "K_PER_SPLIT", "stride_xm", "stride_sn", "stride_om", "magic")
    signature = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*fp16", "perm_ptr": "*i32",
                 "b_ptr": "*bf16", "out_ptr": "*bf16", **dict.fromkeys(ints, "i32"),
                 **dict.fromkeys(("HAS_PERM", "HAS_BIAS", "SPLIT", "THREADS", "RUN", "WORD_ROWS", "FOLD_ZERO", "HOIST",
                                  "JOINT_SUM", "USE_PDL"), "constexpr")}
    # The zero points per code or per step (the defaults: gate_up's two warps, qkv's and down's
    # four), hoisted loads with act-order's gather; under PDL. (Two word rows a program, not a
    # default, spill here.)
    for threads, run, word_rows, fold_zero, hoist in ((128, 32, 1, False, False), (64, 32, 1, True, False),
                                                      (128, 16, 1, True, False), (128, 32, 1, True, False),
                                                      (128, 32, 1, False, True)):
        constants = {"HAS_PERM": hoist, "HAS_BIAS": True, "SPLIT": 1, "THREADS": threads, "RUN": run,
                     "WORD_ROWS": word_rows, "FOLD_ZERO": fold_zero, "HOIST": hoist, "JOINT_SUM": fold_zero,
                     "USE_PDL": True}
        kernel = triton.compile(ASTSource(int4_gemm._int4_gemv_n8_kernel, signature, constants), target=target,
                                options={"num_warps": threads // 32})
        assert "ld.global" in kernel.asm["ptx"] and "ld.local" not in kernel.asm["ptx"], constants
        assert "griddepcontrol.wait" in kernel.asm["ptx"], constants
        _assert_no_spills(kernel)
    from pagedllm.quantization.kernels.splitk import splitk_sum_kernel

    sum_signature = {"ws_ptr": "*fp32", "b_ptr": "*bf16", "out_ptr": "*bf16", "M": "i32", "N": "i32",
                     "stride_om": "i32", **dict.fromkeys(("SPLIT", "HAS_BIAS", "BLOCK", "USE_PDL"), "constexpr")}
    for use_pdl in (False, True):  # int4's launch; fp8's under programmatic dependent launch
        triton.compile(ASTSource(splitk_sum_kernel, sum_signature, {"SPLIT": 7, "HAS_BIAS": True, "BLOCK": 1024,
                                                                    "USE_PDL": use_pdl}), target=target)


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
@pytest.mark.parametrize("block_m", [16, 64])
def test_tiled_gemm_compiles_to_tensor_core_dots_for_hopper(block_m):
    """The tiled GEMM built for sm_90 (no GPU needed): its dot is a tensor-core instruction (wgmma:
    the weight tile is the 64-row operand), the words and inputs load by 16-byte cp.async, and
    nothing spills."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pagedllm.quantization.kernels import int4_gemm

    ints = ("M", "N", "K", "GROUP_SIZE", "K_PER_SPLIT", "stride_xm", "stride_sn", "stride_om")
    signature = {"x_ptr": "*bf16", "qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*fp16",
                 "b_ptr": "*bf16", "out_ptr": "*bf16", **dict.fromkeys(ints, "i32"),
                 **dict.fromkeys(("HAS_BIAS", "SPLIT", "BLOCK_M", "BLOCK_N", "RUN", "CHUNK", "CODE_BITS",
                                  "CODE_BASE"), "constexpr")}
    run, chunk = int4_gemm.tiled_n8_chunk(4096, 128)
    code_bits, code_base = int4_gemm.CODE_BASES[torch.bfloat16]
    constants = {"HAS_BIAS": True, "SPLIT": 1, "BLOCK_M": block_m, "BLOCK_N": 64, "RUN": run,
                 "CHUNK": chunk, "CODE_BITS": code_bits, "CODE_BASE": code_base}
    # The launcher's specialization: pointers, K and the strides are multiples of 16 (vector loads).
    aligned = ("x_ptr", "qw_ptr", "s_ptr", "z_ptr", "b_ptr", "out_ptr", "N", "K", "K_PER_SPLIT",
               "stride_xm", "stride_om")
    attrs = {(list(signature).index(name),): [["tt.divisibility", 16]] for name in aligned}
    kernel = triton.compile(ASTSource(int4_gemm._int4_gemm_n8_kernel, signature, constants, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
    ptx = kernel.asm["ptx"]
    copies = [line for line in ptx.splitlines() if "cp.async.cg.shared.global" in line or "cp.async.ca" in line]
    assert "wgmma.mma_async" in ptx and copies and all("0x10" in line for line in copies)
    _assert_no_spills(kernel)


def test_tiled_gemm_chunks_lie_in_one_group_and_config_divides_the_shape():
    """A chunk is whole GEMV runs of one group (16 to 128 columns); the config's tiles divide N and
    its splits the chunks of K; shapes whose tiles and groups do not nest are refused."""
    from pagedllm.quantization.kernels import int4_gemm

    assert int4_gemm.tiled_n8_chunk(4096, 128) == (32, 128)  # four runs of 32 columns
    assert int4_gemm.tiled_n8_chunk(14336, 128) == (16, 128)
    assert int4_gemm.tiled_n8_chunk(14336, 14336) == (16, 128)  # one group
    assert int4_gemm.tiled_n8_chunk(256, 32) == (8, 32)
    assert int4_gemm.tiled_n8_chunk(1024, 8) is None  # chunks of 8 columns: shorter than a dot
    assert int4_gemm.tiled_n8_chunk(3072, 96) is None  # groups of 96 straddle the 1024-column tiles
    x = torch.empty(2, 4096, dtype=torch.bfloat16)
    assert int4_gemm.tiled_n8_fits(x, 6144, 128) and not int4_gemm.tiled_n8_fits(x.float(), 6144, 128)
    assert not int4_gemm.tiled_n8_fits(x, 6152, 128)  # N not a multiple of 16
    for m in (2, 3, 16, 17, 64, 128):
        for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (48, 1024)]:
            block_m, block_n, split, _, _ = int4_gemm.tiled_n8_config(m, n, k, 128, 132)
            assert block_m >= min(64, m) and n % block_n == 0 and (k // 128) % split == 0, (m, n, k)
    # The splits an H100 sweep found best on the 8B shapes (o, gate_up, down at 16 and 64 rows).
    for m, n, k, split in [(16, 4096, 4096, 8), (16, 28672, 4096, 2), (16, 4096, 14336, 8), (64, 4096, 4096, 4),
                           (64, 28672, 4096, 1), (64, 4096, 14336, 4)]:
        assert int4_gemm.tiled_n8_config(m, n, k, 128, 132)[2] == split, (m, n, k)


# ---- CUDA (the lead runs these on a GPU) -------------------------------------------------------

# Llama-3.1-8B's projections (qkv, o, gate_up, down) at decode and prefill row counts.
GPU_SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("layout", [int4.ROWS_LAYOUT, int4.N8_LAYOUT])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("act_order", [False, True])
def test_kernels_match_the_reference_on_cuda(shape, act_order, layout):
    n, k = shape
    for m in (1, 2, 3, 4, 8, 16, 33, 64, 128, 300):
        err = check_case((m, n, k, 128, act_order, m == 3, torch.bfloat16), "cuda", layout=layout)
        assert err < 1e-2, (m, err)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_each_word_row_kernel_matches_the_reference_on_cuda(shape):
    """Every word-row kernel where it takes the rows, whichever the dispatch picks: the GEMV at 1-4
    rows, the tiled GEMM at 1-128 (float16 and bfloat16, bias, act-order), dequantize + cuBLAS."""
    from pagedllm.quantization.kernels import int4_gemm

    n, k = shape
    qweight, scales, zeros, perm = make_weight(n, k, 128, True, "cuda", layout=int4.N8_LAYOUT)
    kernels = {"gemv": (int4_gemm.int4_gemv_n8, (1, 2, 3, 4)), "tiled": (int4_gemm.int4_gemm_n8, (1, 2, 5, 16, 64, 128)),
               "dequant": (functools.partial(int4_gemm.int4_dequant_matmul, layout=int4.N8_LAYOUT), (1, 64))}
    for name, (kernel, rows) in kernels.items():
        for m in rows:
            for dtype in (torch.bfloat16, torch.float16):
                x = torch.randn(m, k, device="cuda", dtype=dtype)
                bias = torch.randn(n, device="cuda", dtype=dtype)
                want = int4.int4_linear_reference(x, qweight, scales, zeros, perm, 128, int4.N8_LAYOUT) + bias.float()
                got = kernel(x, qweight, scales, zeros, perm, 128, bias)
                err = float((got.float() - want).abs().max() / want.abs().max())
                assert got.dtype == dtype and err < 1e-2, (name, m, dtype, err)


def _max_rel_err(kernel, m: int, weight: tuple, config: tuple) -> float:
    """``kernel``'s error against the reference on the down projection's shape (bias, act-order)."""
    qweight, scales, zeros, perm = weight
    x = torch.randn(m, 14336, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    want = int4.int4_linear_reference(x, qweight, scales, zeros, perm, 128, int4.N8_LAYOUT) + bias.float()
    got = kernel(x, qweight, scales, zeros, perm, 128, bias, config=config)
    return float((got.float() - want).abs().max() / want.abs().max())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("config", [(4, 16, 1), (4, 16, 7), (2, 16, 7), (1, 16, 14)])
def test_word_row_gemv_launch_sizes_on_cuda(config):
    """GEMV sizes the benchmark sweeps (split K included) on the down projection's shape."""
    from pagedllm.quantization.kernels import int4_gemm

    weight = make_weight(4096, 14336, 128, True, "cuda", layout=int4.N8_LAYOUT)
    for m in (1, 2, 4):
        assert _max_rel_err(int4_gemm.int4_gemv_n8, m, weight, config) < 1e-2, (m, config)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("config", [(16, 128, 4, 8, 3), (64, 64, 7, 4, 4), (32, 64, 2, 8, 5), (16, 32, 16, 4, 3)])
def test_tiled_gemm_launch_sizes_on_cuda(config):
    """Tiled-GEMM sizes the benchmark sweeps (output tiles, warps, stages, split K)."""
    from pagedllm.quantization.kernels import int4_gemm

    weight = make_weight(4096, 14336, 128, True, "cuda", layout=int4.N8_LAYOUT)
    for m in (1, 5, 16, 64):
        assert _max_rel_err(int4_gemm.int4_gemm_n8, m, weight, config) < 1e-2, (m, config)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("layout", [int4.ROWS_LAYOUT, int4.N8_LAYOUT])
@pytest.mark.parametrize("m", [1, 64])
def test_kernels_replay_in_a_cuda_graph(m, layout):
    from pagedllm.quantization.kernels import int4_gemm

    qweight, scales, zeros, perm = make_weight(4096, 4096, 128, True, "cuda", layout=layout)
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)

    def run():
        return int4_gemm.int4_linear(x, qweight, scales, zeros, perm, 128, None, layout=layout)

    eager = run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, run())
    assert not torch.equal(out, eager)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("quant_method", ["gptq", "awq"])
def test_a_checkpoint_on_cuda_gives_its_dequantized_models_logits(tmp_path, quant_method):
    """bf16 on CUDA with the fused kernels on (batch 1, 2 and more rows through the Triton paths)."""
    from pagedllm.config import KernelConfig
    from pagedllm.layers.dispatch import prepare_model_kernels
    from pagedllm.loader import load_hf_config, resolve_model
    from pagedllm.models import load_model
    from pagedllm.quantization import get_quantization_config
    from tests.helpers import PagedTestRunner, make_tiny_model
    from tests.quantization.int4_checkpoints import awq_config, gptq_config, write_int4_checkpoint

    qcfg = gptq_config(32, desc_act=True) if quant_method == "gptq" else awq_config(32)
    quant_dir, float_dir = write_int4_checkpoint(make_tiny_model("llama", tmp_path / "f", seed=1), tmp_path, qcfg)

    def logits(folder):
        source = resolve_model(folder)
        hf_config = load_hf_config(source)
        model = load_model(source, hf_config, torch.bfloat16, "cuda", get_quantization_config(None, hf_config))
        prepare_model_kernels(model, torch.device("cuda"), KernelConfig())
        runner = PagedTestRunner(model, num_blocks=64, block_size=4)
        chunks = ([(0, list(range(3, 40))), (1, list(range(50, 59)))], [(0, [100])], [(0, [101]), (1, [102])])
        return torch.cat([torch.cat(runner.step(c)) for c in chunks]).float()

    got, want = logits(quant_dir), logits(float_dir)
    assert float((got - want).abs().mean()) < 0.05 * float(want.abs().mean())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("config", [(4, 32, 1, 2, False), (4, 32, 1, 1, True), (2, 32, 2, 2, True),
                                    (4, 32, 1, 1, True, True), (4, 32, 1, 1, True, False, True),
                                    (2, 32, 1, 2, False, False, True)])
def test_word_row_gemv_options_on_cuda(config):
    """Two word rows a program, folded zero points, hoisted loads, the sums reduced at once on the qkv
    shape, float16 and bfloat16."""
    for m in (1, 2):
        for dtype in (torch.bfloat16, torch.float16):
            err = check_case((m, 6144, 4096, 128, True, True, dtype, config), "cuda", layout=int4.N8_LAYOUT)
            assert err < 1e-2, (config, m, dtype, err)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("quant_method", ["gptq", "awq"])
def test_a_word_row_checkpoint_on_cuda_gives_the_dequantized_logits(tmp_path, monkeypatch, quant_method):
    """A llama of 128 hidden and 256 intermediate features (the word-row layout takes qkv, gate_up
    and down), no act-order, bf16 with the fused kernels on: at one and two decode rows the
    word-row GEMV runs them (zero points folded by default), and the logits are those of the
    dequantized float model."""
    import transformers

    from pagedllm.config import KernelConfig
    from pagedllm.layers.dispatch import prepare_model_kernels
    from pagedllm.loader import load_hf_config, resolve_model
    from pagedllm.models import load_model
    from pagedllm.quantization import get_quantization_config
    from pagedllm.quantization.kernels import int4_gemm
    from tests.helpers import PagedTestRunner, default_tokenizer, tiny_config
    from tests.quantization.int4_checkpoints import awq_config, gptq_config, write_int4_checkpoint

    cfg = tiny_config("llama").to_dict()
    cfg.update(hidden_size=128, intermediate_size=256)
    torch.manual_seed(1)
    hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            param.normal_(1.0, 0.1) if "norm" in name else param.normal_(0.0, 0.05)
    hf_model.save_pretrained(tmp_path / "f")
    default_tokenizer().save_pretrained(tmp_path / "f")
    qcfg = gptq_config(32) if quant_method == "gptq" else awq_config(32)
    quant_dir, float_dir = write_int4_checkpoint(str(tmp_path / "f"), tmp_path, qcfg)
    calls = []
    gemv = int4_gemm.int4_gemv_n8
    monkeypatch.setattr(int4_gemm, "int4_gemv_n8", lambda x, *a, **k: calls.append(x.shape[0]) or gemv(x, *a, **k))

    def logits(folder):
        source = resolve_model(folder)
        hf_config = load_hf_config(source)
        model = load_model(source, hf_config, torch.bfloat16, "cuda", get_quantization_config(None, hf_config))
        prepare_model_kernels(model, torch.device("cuda"), KernelConfig())
        runner = PagedTestRunner(model, num_blocks=64, block_size=4)
        chunks = ([(0, list(range(3, 40))), (1, list(range(50, 59)))], [(0, [100])], [(0, [101]), (1, [102])])
        return torch.cat([torch.cat(runner.step(c)) for c in chunks]).float()

    got = logits(quant_dir)
    assert calls.count(1) >= 3 * 3 and calls.count(2) >= 3 * 3 and int4_gemm.N8_FOLD_ZERO
    want = logits(float_dir)
    assert float((got - want).abs().mean()) < 0.05 * float(want.abs().mean())
