"""pagedllm.quantization: quantized linear layers, one method class per scheme (vLLM's shape).

    quant_config = get_quantization_config("fp8", hf_config)   # None: no quantization
    quantize_model(model, quant_config)      # right after build: each linear gets its method
    ... load the checkpoint (or dummy weights) ...
    process_quantized_weights(model)         # the layers' final (quantized) form

Schemes (``QUANTIZATION_METHODS``): ``fp8`` (online on a float checkpoint, or an FP8 checkpoint),
``compressed-tensors`` (FP8 checkpoints), ``gptq`` and ``awq`` (int4 checkpoints, served in the
form of ``int4.py``) and ``gguf`` (a GGUF file's blocks kept packed; implied by a GGUF model file).
``base.py`` has the two interfaces.
"""

from pagedllm.quantization.base import QuantizationConfig, QuantizeMethodBase
from pagedllm.quantization.registry import (
    QUANTIZATION_METHODS,
    get_quantization_config,
    init_dummy_quantized_weights,
    process_quantized_weights,
    quantize_model,
)

__all__ = [
    "QUANTIZATION_METHODS",
    "QuantizationConfig",
    "QuantizeMethodBase",
    "get_quantization_config",
    "init_dummy_quantized_weights",
    "process_quantized_weights",
    "quantize_model",
]
