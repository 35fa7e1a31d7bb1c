"""LoRARequest: which adapter a request runs with (vLLM's ``vllm.lora.request.LoRARequest``).

Pure Python: the engine, the scheduler (``lora_int_id``: the prefix-cache key and the per-step
adapter count) and the server hold it; only the worker reads the weights at ``lora_path``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter: a human name, a globally unique positive integer id and a PEFT folder.

    Two requests with the same ``lora_int_id`` run the same adapter (the id keys the worker's
    caches and the prefix cache); the engine refuses one id used with two different paths.
    ``base_model_name`` (vLLM's): the model it adapts, informational (``/v1/models`` parent)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be the path of a PEFT adapter folder, got {self.lora_path!r}")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
