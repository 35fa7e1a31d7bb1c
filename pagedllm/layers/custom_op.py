"""One layer, several implementations, chosen once per device (in the spirit of vLLM's ``CustomOp``).

A ``CustomOp`` computes one function with up to three implementations:

- ``forward_native``: plain torch, on any device (the oracle of the tests);
- ``forward_cpu``: the CPU form (our C kernels, or oneDNN with prepacked weights), falling back to
  ``forward_native`` where its kernel does not take the inputs;
- ``forward_cuda``: the CUDA form (Triton kernels, cuBLAS / cuBLASLt), which decides per call among
  shape classes (e.g. 1, 2 or 3+ rows) and falls back to ``forward_native`` where no kernel applies.

``select(plan)`` (called by ``layers/dispatch.prepare_model_kernels``) picks one of them from the
engine's ``KernelConfig`` and the plan's device, and ``forward`` then calls it: no per-call test of
a global switch. A freshly built module runs ``forward_cpu`` (so a module used directly on the CPU,
as in the tests, takes the same path as an engine on the CPU).

``fuses_kernels``: whether the fused methods of the op (e.g. ``Linear.forward_norm_prologue``,
which read the module's parameters inside a kernel that also runs the op before it) compute what
``forward`` computes. A subclass that overrides ``forward`` or an implementation (directly or
through a mixin) without saying ``fuses_kernels`` in that class body gets ``False``, so the fused
methods and the compound modules of ``layers/compound.py`` call its plain ``forward`` instead (a
LoRA or quantized linear is never bypassed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from torch import nn

from pagedllm.layers.tuning import HOPPER, DeviceTuning

if TYPE_CHECKING:
    from pagedllm.layers.kernel_plan import KernelPlan

_FORWARDS = ("forward", "forward_native", "forward_cpu", "forward_cuda", "forward_cublas")


class CustomOp(nn.Module):
    """A layer whose implementation is chosen once (``select``); ``impl`` names the chosen one.

    Invariant: every implementation computes ``forward_native``'s function (up to float summation
    order and the roundings each kernel's docstring names). Cost per call: one bound-method call on
    top of the implementation."""

    fuses_kernels: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A class whose forward or implementation comes from a class (itself, a base or a mixin)
        that does not say ``fuses_kernels`` gets ``fuses_kernels = False``."""
        super().__init_subclass__(**kwargs)
        if "fuses_kernels" in cls.__dict__:
            return
        for name in _FORWARDS:
            owner = next((c for c in cls.__mro__ if name in c.__dict__), None)
            if owner is not None and "fuses_kernels" not in owner.__dict__:
                cls.fuses_kernels = False
                return

    def __init__(self) -> None:
        super().__init__()
        self.tuning: DeviceTuning = HOPPER
        self.use_impl("cpu")

    def use_impl(self, impl: str) -> None:
        """Run ``forward_<impl>`` from now on (``select`` chooses; tests and benchmarks may force one)."""
        self.impl = impl
        self._forward = getattr(self, f"forward_{impl}")

    def set_quant_method(self, method) -> None:
        """Hold this layer's weights in ``method``'s scheme (a ``pagedllm.quantization`` method),
        before they load: its parameters become the scheme's (``create_weights``) and every call
        runs ``forward_quantized``, which the layer defines; the fused kernels, which read
        ``weight`` as a float matrix, and GEMM tuning are off for it."""
        self.quant_method = method
        self.fuses_kernels = False
        self.gemm_tunable = False
        method.create_weights(self)
        self.use_impl("quantized")

    def select(self, plan: KernelPlan) -> str:
        """Choose this op's implementation for ``plan``'s device and kernel config; returns its name."""
        self.tuning = plan.tuning
        self.use_impl(self.choose_impl(plan))
        return self.impl

    def choose_impl(self, plan: KernelPlan) -> str:
        """``cuda`` where the fused Triton kernels are allowed on a CUDA device, ``cpu`` on the CPU
        with the C kernels allowed, else ``native``."""
        if plan.device.type == "cuda":
            return "cuda" if plan.fused_kernels else "native"
        if plan.device.type == "cpu" and plan.config.cpu_kernels:
            return "cpu"
        return "native"

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward_cuda(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)
