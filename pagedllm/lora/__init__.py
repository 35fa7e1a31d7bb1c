"""Multi-LoRA: serve many PEFT adapters over one base model, mixed in one batch.

- ``request.py``: ``LoRARequest`` (pure Python; what a request names).
- ``peft_config.py``: reads and checks a PEFT folder without torch (the engine's validation).
- ``adapter.py``: loads a PEFT folder's A / B matrices (the worker's CPU cache holds these).
- ``mapping.py``: a step's tokens grouped by adapter slot;
- ``punica.py``: the batched LoRA ops (shrink ``x @ A^T``, expand ``@ B^T`` added to the base
  output, grouped by adapter): grouped matmuls in torch; ``kernels.py``: the Triton form (CUDA).
- ``layers.py``: the stacked per-slot A / B buffers of one linear layer and its delta.
- ``manager.py``: the worker's adapters: ``max_loras`` device slots, LRU-evicted to a CPU cache
  of ``max_cpu_loras``, and each step's token -> slot mapping.

Only ``request.py`` and ``peft_config.py`` are torch-free; this package root imports neither.
"""
