"""compile_only(): Triton launches inside the scope compile (in parallel) without running."""

from __future__ import annotations

import sys

import pytest
import torch

from pagedllm.worker.parallel_compile import compile_only

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only install has no Triton
    triton = None

if triton is not None:

    @triton.jit
    def _add(x_ptr, n, value, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + value, mask=mask)


def test_scope_is_inactive_without_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton.runtime", None)  # import triton.runtime now fails
    with compile_only() as active:
        assert active is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_launches_inside_compile_but_do_not_run():
    x = torch.zeros(100, device="cuda")
    with compile_only() as active:
        assert active
        _add[(1,)](x, 100, 1.0, BLOCK=128)
        _add[(1,)](x, 100, 1.0, BLOCK=256)  # a second variant, compiled alongside
        torch.cuda.synchronize()
        assert not x.any()  # nothing ran
    cache = _add.device_caches[torch.cuda.current_device()][0]
    assert len(cache) == 2  # both variants compiled and cached by the time the scope ends
    _add[(1,)](x, 100, 1.0, BLOCK=128)
    _add[(1,)](x, 100, 2.0, BLOCK=256)
    assert len(cache) == 2  # no new compilation
    assert bool((x == 3.0).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_launchers_are_built_inside_the_scope(monkeypatch):
    """Each compiled kernel's host launcher (a C module) is built when the scope ends, into Triton's
    cache, where the kernel's first launch then finds it."""
    from triton.runtime.driver import driver

    built = []
    original = driver.active.launcher_cls

    def counting_launcher(src, metadata):
        built.append(src.fn.__name__)
        return original(src, metadata)

    monkeypatch.setattr(driver.active, "launcher_cls", counting_launcher)
    x = torch.zeros(100, device="cuda")
    with compile_only():
        _add[(1,)](x, 100, 1.0, BLOCK=512)
    assert built == ["_add"]
    _add[(1,)](x, 100, 1.0, BLOCK=512)
    assert bool((x == 1.0).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_start_up_dry_pass_includes_the_sampler(monkeypatch, tmp_path):
    """The engine's parallel dry pass runs the sampler too (its kernels compile with the others),
    and the real warm-up runs it again outside the scope."""
    from triton.runtime import _async_compile

    from pagedllm import EngineArgs
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.sample.sampler import Sampler
    from tests.helpers import make_tiny_model

    inside_scope = []
    original_call = Sampler.__call__

    def recording_call(self, logits, meta):
        inside_scope.append(_async_compile.active_mode.get() is not None)
        return original_call(self, logits, meta)

    monkeypatch.setattr(Sampler, "__call__", recording_call)
    LLMEngine.from_engine_args(EngineArgs(model=make_tiny_model("qwen3", tmp_path), dtype="bfloat16",
                                          gpu_memory_utilization=0.3, skip_tokenizer_init=True))
    assert True in inside_scope and False in inside_scope
