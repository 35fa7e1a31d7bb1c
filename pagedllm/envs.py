"""The one reader of the environment variables the engine honours.

Every variable is listed in ``VARIABLES`` with its type, default and meaning: our ``PAGEDLLM_*``
ones and those of other tools that change what we run (``OMP_NUM_THREADS``, ``CC``,
``TRITON_INTERPRET``); no other
module reads ``os.environ``. Values are read when asked for
(``envs.PAGEDLLM_FUSED_OPS``), not at import, so a test or a launcher can set them before it
builds an engine. Booleans share one parser: ``0``, ``false``, ``no``, ``off`` (any case) are
false, ``1``, ``true``, ``yes``, ``on`` are true, anything else is a ``ValueError`` naming the
variable (a typo never silently keeps the default).

The engine reads the kernel switches once, when it builds its ``KernelConfig``
(``engine/config_builder.py``); from then on the typed config, not the environment, decides.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_bool(name: str, text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"environment variable {name}={text!r}: expected one of {_TRUE + _FALSE}")


@dataclass(frozen=True)
class EnvVar:
    name: str
    kind: str  # "bool" | "int" | "str" | "path"
    default: Any
    help: str

    def read(self) -> Any:
        text = os.environ.get(self.name)
        if text is None or text == "":
            return self.default
        if self.kind == "bool":
            return parse_bool(self.name, text)
        if self.kind == "path":
            return Path(text).expanduser()
        if self.kind == "int":
            try:
                return int(text)
            except ValueError:
                raise ValueError(f"environment variable {self.name}={text!r}: expected an integer") from None
        return text


VARIABLES: dict[str, EnvVar] = {v.name: v for v in (
    EnvVar("PAGEDLLM_FUSED_OPS", "bool", True,
           "Fused Triton kernels for norms, RoPE, activations and the small-batch GEMVs on CUDA."),
    EnvVar("PAGEDLLM_PDL", "bool", True,
           "Programmatic dependent launch in the batch-1 decode CUDA graphs (Hopper and newer)."),
    EnvVar("PAGEDLLM_SYMM_MEM_ALL_REDUCE", "bool", True,
           "Tensor parallel on CUDA: all-reduce decode-sized activations with PyTorch's one-shot "
           "symmetric-memory kernel (peer reads over NVLink) instead of NCCL."),
    EnvVar("PAGEDLLM_FOLD_NORMS", "bool", True,
           "Fold the decoder layers' RMSNorm weights into the projections after them on CUDA "
           "(enables the residual-stream forward)."),
    EnvVar("PAGEDLLM_GEMM_TUNING", "bool", True,
           "Time cuBLAS against cuBLASLt per weight shape and graph batch size at start-up."),
    EnvVar("PAGEDLLM_CPU_KERNELS", "bool", True,
           "Build and use the C kernels for the CPU path (decode attention, norms, activations)."),
    EnvVar("PAGEDLLM_GGUF_INT8_ACTIVATIONS", "bool", False,
           "GGUF Q4_0 / Q4_1 / Q8_0 on the CPU: 1 rounds the activations to int8 blocks (llama.cpp's scheme) "
           "and takes integer dot products (faster at batch 8 and up; logits within ~5% of their largest "
           "value, perplexity within 0.1%); default: float activations (logits equal to the dequantized "
           "model's within 1e-5)."),
    EnvVar("PAGEDLLM_PLAIN_CONFIG", "bool", True,
           "Read config.json of known model types without importing transformers' config classes."),
    EnvVar("PAGEDLLM_CACHE_DIR", "path", Path("~/.cache/pagedllm").expanduser(),
           "Where the compiled CPU kernels and converted model files are kept."),
    EnvVar("PAGEDLLM_API_KEY", "str", None,
           "The server's API key when --api-key is not given."),
    EnvVar("PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING", "bool", False,
           "The server serves POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's "
           "VLLM_ALLOW_RUNTIME_LORA_UPDATING): adapters added and removed while it runs."),
    EnvVar("PAGEDLLM_LOG_LEVEL", "str", "INFO",
           "Log level of the command-line tools."),
    EnvVar("PAGEDLLM_COMMIT", "str", None,
           "The commit recorded in benchmark results (a copied tree may carry a stale .git)."),
    EnvVar("PAGEDLLM_CPU_THREADS", "int", None,
           "Threads of torch's intra-op pool on the CPU (unset: the CPUs this process may use, from its "
           "affinity and cgroup quota, less one for the server's event loop when more than two)."),
    EnvVar("OMP_NUM_THREADS", "int", None,
           "OpenMP's thread count; used as the CPU thread count when PAGEDLLM_CPU_THREADS is unset."),
    EnvVar("CC", "str", "cc", "The C compiler that builds the CPU kernels."),
    EnvVar("RAY_ADDRESS", "str", None,
           "The Ray cluster distributed_executor_backend='ray' joins (unset: a local Ray instance is started)."),
    EnvVar("TRITON_INTERPRET", "bool", False,
           "Triton's interpreter runs the kernels on the CPU (tests); programmatic dependent launch is off."),
)}


def __getattr__(name: str) -> Any:
    var = VARIABLES.get(name)
    if var is None:
        raise AttributeError(f"module 'pagedllm.envs' has no attribute {name!r}")
    return var.read()


def __dir__() -> list[str]:
    return sorted([*globals(), *VARIABLES])


def markdown_table(escape: Callable[[str], str] = str) -> str:
    """The variables as a Markdown table (rendered into the docs)."""
    rows = ["| variable | type | default | meaning |", "|---|---|---|---|"]
    for v in VARIABLES.values():
        default = "unset" if v.default is None else ("~/.cache/pagedllm" if v.kind == "path" else str(v.default))
        rows.append(f"| `{v.name}` | {v.kind} | {escape(default)} | {escape(v.help)} |")
    return "\n".join(rows)
