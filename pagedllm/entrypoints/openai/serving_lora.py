"""The LoRA adapters a server serves by name: ``--lora-modules``, ``/v1/models``, and the runtime
``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` (vLLM's endpoints, registered only when
``PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING`` is on, as vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``).

A request picks an adapter by its ``model`` field. Each adapter gets a new ``lora_int_id`` when it
is registered (from 1, never reused), so an adapter unloaded and loaded again from another folder
never meets the old one's prefix-cache blocks or worker slots. Adapter folders are checked when
registered (``lora.peft_config``: rank, targets, shapes), so a bad one is a 400 (or a start-up
error), never a failing step.
"""

from __future__ import annotations

import json

from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request
from pagedllm.entrypoints.openai.protocol import Int, OpenAIBaseModel, Str
from pagedllm.lora.peft_config import read_adapter_spec
from pagedllm.lora.request import LoRARequest


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: Str
    lora_path: Str


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: Str
    lora_int_id: Int | None = None


def parse_lora_module(value: str) -> tuple[str, str, str | None]:
    """``name=path`` or vLLM's JSON ``{"name": ..., "path": ..., "base_model_name": ...}`` ->
    ``(name, path, base_model_name)``; ValueError naming ``--lora-modules``."""
    if value.lstrip().startswith("{"):
        try:
            spec = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules: {value!r} is not valid JSON: {e}") from None
        unknown = sorted(set(spec) - {"name", "path", "base_model_name"}) if isinstance(spec, dict) else None
        if not isinstance(spec, dict) or unknown or not isinstance(spec.get("name"), str) \
                or not isinstance(spec.get("path"), str):
            raise ValueError(f"--lora-modules: {value!r} must be an object with string 'name' and 'path' "
                             "(and optionally 'base_model_name')")
        return spec["name"], spec["path"], spec.get("base_model_name")
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora-modules: {value!r} must be name=path or a JSON object")
    return name, path, None


class LoRAModules:
    """Served adapter name -> its ``LoRARequest``. Invariant: names are unique and never one of the
    base model's served names; ids increase. Cost: a dict lookup per request."""

    def __init__(self, max_lora_rank: int | None, hf_config, base_model_name: str, reserved_names: list[str]) -> None:
        self.max_lora_rank = max_lora_rank  # None: LoRA is off, no adapter can be added
        self.hf_config = hf_config
        self.base_model_name = base_model_name
        self.reserved_names = set(reserved_names)
        self.adapters: dict[str, LoRARequest] = {}
        self._next_id = 1

    def __contains__(self, name: object) -> bool:
        return name in self.adapters

    def get(self, name: str | None) -> LoRARequest | None:
        return self.adapters.get(name) if name else None

    def add(self, name: str, path: str, base_model_name: str | None = None, field: str = "lora_path") -> LoRARequest:
        """Check the folder and register it under ``name``; ValueError naming ``field`` (or
        ``lora_name`` for a name in use)."""
        if self.max_lora_rank is None:
            raise ValueError(f"{field}: LoRA adapters need an engine started with --enable-lora")
        if name in self.adapters or name in self.reserved_names:
            raise ValueError(f"lora_name: The lora adapter '{name}' has already been loaded.")
        read_adapter_spec(path, self.max_lora_rank, self.hf_config, field=field)
        request = LoRARequest(name, self._next_id, path, base_model_name or self.base_model_name)
        self._next_id += 1
        self.adapters[name] = request
        return request

    def load(self, body: LoadLoRAAdapterRequest) -> str:
        """``/v1/load_lora_adapter``: vLLM's success text, or a 400 naming the field."""
        try:
            self.add(body.lora_name, body.lora_path)
        except ValueError as e:
            raise bad_request(e, {"lora_name", "lora_path"}, default_param="lora_path") from e
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    def unload(self, body: UnloadLoRAAdapterRequest) -> str:
        """``/v1/unload_lora_adapter``: 404 for an unknown name (or a name and a mismatching id).
        Requests already running with it finish with it; new ones get a 404."""
        request = self.adapters.get(body.lora_name)
        if request is None or (body.lora_int_id is not None and body.lora_int_id != request.lora_int_id):
            raise OpenAIError(404, f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name",
                              code="model_not_found")
        del self.adapters[body.lora_name]
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
