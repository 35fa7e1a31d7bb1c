"""LoRAModelManager: the worker's adapters, its LoRA layers and each step's slot mapping.

Two caches, both least-recently-used:

- device slots (``max_loras``): each LoRA layer's stacked A / B (``layers.py``) hold up to
  ``max_loras`` adapters; ``slot_of[lora_int_id]`` says where. A step needs its adapters in slots
  (the scheduler never schedules more distinct adapters than ``max_loras`` in a step); a missing one
  takes a free slot or evicts the least recently used adapter that this step does not use.
- CPU (``max_cpu_loras``): adapters read from their folders (``adapter.py``), so an evicted adapter
  comes back to a slot without reading its files again.

The layers add their delta only while ``step`` runs a forward with adapters: they are switched to
the LoRA implementation (``Linear.set_lora_active``) when a step with adapters follows one
without, and back at the next step without, so a batch of the base model alone runs exactly the
code (fused kernels, CUDA graphs) of an engine without LoRA. A decode step with adapters replays
a graph of its own, captured with the delta (``graph_step``), after ``stage_graph`` wrote its
grouping into the graph's fixed mapping (a non-blocking copy: the host does not wait for the GPU).
On CUDA the layers' shrink outputs live side by side in one workspace (``LoRAStepState``), which
a forward pre-hook on the model zeroes with one launch at the start of each forward with adapters
(inside a graph's capture too), instead of one zeroed buffer per layer.
Cost per step with adapters: O(scheduled tokens) numpy for the mapping, plus, per adapter that
enters a slot, one copy of its matrices into every LoRA layer.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator

import numpy as np
import torch
from torch import nn

from pagedllm.layers.compound import NormLinear
from pagedllm.layers.linear import Linear, MergedLinear
from pagedllm.lora.adapter import LoRAAdapterWeights, load_adapter
from pagedllm.lora.layers import LoRALinearWeights, LoRAStepState
from pagedllm.lora.mapping import GraphMapping, LoRABatchMapping, build_mapping
from pagedllm.lora.peft_config import SUPPORTED_TARGETS, read_adapter_spec
from pagedllm.lora.request import LoRARequest


class LoRAModelManager:
    """See the module doc. Invariant: ``slot_of`` and ``slot_ids`` are inverse (an adapter is in at
    most one slot, a slot holds at most one adapter, ``None`` = free); ``cpu_cache`` holds at most
    ``max_cpu_loras`` adapters; the layers are LoRA-active iff ``active``."""

    def __init__(self, model: nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
                 device: torch.device, dtype: torch.dtype, hf_config=None) -> None:
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.device = device
        self.hf_config = hf_config
        self.state = LoRAStepState()
        self.layers: dict[str, LoRALinearWeights] = {}  # our module path -> its LoRA weights
        # checkpoint module path (model.layers.0.self_attn.q_proj) -> (LoRA weights, slice index)
        self.targets: dict[str, tuple[LoRALinearWeights, int]] = {}
        self._linears: list[Linear] = []
        packed = dict(getattr(model, "packed_modules_mapping", {}))
        for name, module in model.named_modules():
            if isinstance(module, Linear):
                self._add_layer(name, module, packed, dtype)
        if not self.layers:
            raise ValueError("enable_lora: the model has no layer a LoRA adapter can target")
        self._record_norm_weights(model)
        self.slot_ids: list[int | None] = [None] * max_loras
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # LRU order: least recently used first
        self.cpu_cache: OrderedDict[int, LoRAAdapterWeights] = OrderedDict()
        self.requests: dict[int, LoRARequest] = {}
        self.active = False
        self.graph_mapping: GraphMapping | None = None  # set once decode graphs with LoRA are captured
        col = 0
        for weights in self.layers.values():
            weights.workspace_col, col = col, col + weights.width
        self._workspace_width = col
        if device.type == "cuda":
            model.register_forward_pre_hook(self._zero_workspace)

    def _add_layer(self, name: str, linear: Linear, packed: dict[str, list[str]], dtype: torch.dtype) -> None:
        prefix, short = name.rsplit(".", 1) if "." in name else ("", name)
        projections = packed.get(short, [short])
        if not set(projections) <= set(SUPPORTED_TARGETS):
            return
        if isinstance(linear, MergedLinear):
            slices = [(p, off, size) for p, off, size in zip(projections, linear.offsets, linear.output_sizes)]
        else:
            slices = [(projections[0], 0, linear.out_features)]
        weights = LoRALinearWeights(linear.in_features, linear.out_features, slices, self.max_loras,
                                    self.max_lora_rank, dtype, self.device, self.state)
        linear.lora = weights
        self.layers[name] = weights
        self._linears.append(linear)
        for i, p in enumerate(projections):
            self.targets[f"{prefix}.{p}" if prefix else p] = (weights, i)

    def _record_norm_weights(self, model: nn.Module) -> None:
        """Keep the weight of each norm that ``fold_norms`` may fold into a LoRA layer (call before
        the kernels are prepared); ``use_folded_norms`` then applies or drops them."""
        self._norm_weights = [(pair.linear.lora, pair.norm.weight.detach().clone()) for pair in model.modules()
                              if isinstance(pair, NormLinear) and getattr(pair.linear, "lora", None) is not None]

    def use_folded_norms(self, folded: bool) -> None:
        """Whether the kernel preparation folded the norms into the layers: their A are then scaled
        by the recorded norm weights when a slot is written (before any adapter is loaded)."""
        for weights, norm_weight in self._norm_weights if folded else ():
            weights.input_scale = norm_weight
        self._norm_weights = []

    # -- adapters ---------------------------------------------------------------------------
    def add_request(self, lora_request: LoRARequest | None) -> None:
        """Remember a new request's adapter (its weights are read when a step first needs it)."""
        if lora_request is not None:
            self.requests[lora_request.lora_int_id] = lora_request

    def _cpu_adapter(self, lora_int_id: int) -> LoRAAdapterWeights:
        adapter = self.cpu_cache.get(lora_int_id)
        if adapter is not None:
            self.cpu_cache.move_to_end(lora_int_id)
            return adapter
        request = self.requests[lora_int_id]
        spec = read_adapter_spec(request.lora_path, self.max_lora_rank, self.hf_config)
        adapter = load_adapter(spec, lora_int_id)
        while len(self.cpu_cache) >= self.max_cpu_loras:
            self.cpu_cache.popitem(last=False)
        self.cpu_cache[lora_int_id] = adapter
        return adapter

    def _slot_for(self, lora_int_id: int, needed: set[int]) -> int:
        slot = self.slot_of.get(lora_int_id)
        if slot is not None:
            self.slot_of.move_to_end(lora_int_id)
            return slot
        adapter = self._cpu_adapter(lora_int_id)
        if None in self.slot_ids:
            slot = self.slot_ids.index(None)
        else:
            victim = next(i for i in self.slot_of if i not in needed)
            slot = self.slot_of.pop(victim)
        self._write_slot(slot, adapter)
        self.slot_ids[slot] = lora_int_id
        self.slot_of[lora_int_id] = slot
        return slot

    def _write_slot(self, slot: int, adapter: LoRAAdapterWeights) -> None:
        per_layer: dict[int, tuple[LoRALinearWeights, dict]] = {id(w): (w, {}) for w in self.layers.values()}
        for module, (a, b) in adapter.modules.items():
            target = self.targets.get(module)
            if target is None:
                raise ValueError(f"lora_request: adapter {adapter.lora_int_id} targets {module!r}, which this "
                                 "model has no LoRA layer for")
            weights, index = target
            per_layer[id(weights)][1][index] = (a, b)
        for weights, matrices in per_layer.values():
            weights.set_slot(slot, matrices)

    def remove_adapter(self, lora_int_id: int) -> None:
        """Forget an adapter (its slot becomes free, its CPU copy is dropped)."""
        slot = self.slot_of.pop(lora_int_id, None)
        if slot is not None:
            self.slot_ids[slot] = None
        self.cpu_cache.pop(lora_int_id, None)
        self.requests.pop(lora_int_id, None)

    # -- steps ------------------------------------------------------------------------------
    def prepare_step(self, lora_ids: np.ndarray, num_scheduled: np.ndarray) -> np.ndarray | None:
        """The slot of each token of a step whose request ``i`` runs adapter ``lora_ids[i]`` (0:
        none) over ``num_scheduled[i]`` tokens (-1: none), with every adapter it needs in a slot;
        None when no request has an adapter."""
        if not lora_ids.any():
            return None
        needed = {int(i) for i in np.unique(lora_ids) if i > 0}
        assert len(needed) <= self.max_loras, "the scheduler scheduled more adapters than max_loras"
        slot_by_id = {i: self._slot_for(i, needed) for i in needed}
        slots = np.fromiter((slot_by_id.get(int(i), -1) for i in lora_ids), dtype=np.int64, count=len(lora_ids))
        return np.repeat(slots, num_scheduled)

    def eager_mapping(self, token_slots: np.ndarray) -> LoRABatchMapping | None:
        return build_mapping(token_slots, self.device)

    # -- CUDA graphs --------------------------------------------------------------------------
    def enable_graphs(self, max_tokens: int) -> None:
        """Allocate the fixed mapping that decode graphs with LoRA read (``mapping.GraphMapping``)
        and, on CUDA, the shrink workspace for forwards of up to ``max_tokens`` tokens."""
        self.graph_mapping = GraphMapping(max_tokens, self.max_loras, self.device)
        if self.device.type == "cuda":
            self.state.workspace = torch.zeros(max_tokens, self._workspace_width, dtype=torch.float32,
                                               device=self.device)

    def _zero_workspace(self, model: nn.Module, args: tuple) -> None:
        """Forward pre-hook: zero the workspace rows of this forward's tokens when it runs adapters
        (``args[0]``: the token ids; a forward with more tokens than rows does not use it)."""
        state = self.state
        state.zeroed_rows = 0
        if state.mapping is None or state.workspace is None or not args or not torch.is_tensor(args[0]):
            return
        num_tokens = args[0].shape[0]
        if num_tokens <= state.workspace.shape[0]:
            state.workspace[:num_tokens].zero_()
            state.zeroed_rows = num_tokens

    def graph_step(self, num_tokens: int):
        """The context a decode graph of ``num_tokens`` tokens is captured in: the layers add the
        delta of whatever grouping ``stage_graph`` wrote last (all groups empty at capture)."""
        return self.step(self.graph_mapping.for_size(num_tokens))

    def stage_graph(self, token_slots: np.ndarray) -> None:
        """Write a decode step's grouping where its graph reads it (before the replay)."""
        self.graph_mapping.stage(token_slots)

    @contextlib.contextmanager
    def step(self, mapping: LoRABatchMapping | None) -> Iterator[None]:
        """Run one forward with ``mapping`` (None: the base model alone; see the module doc)."""
        if mapping is None:
            if self.active:
                self._set_active(False)
            yield
            return
        if not self.active:
            self._set_active(True)
        self.state.mapping = mapping
        try:
            yield
        finally:
            self.state.mapping = None

    def _set_active(self, active: bool) -> None:
        for linear in self._linears:
            linear.set_lora_active(active)
        self.active = active
