"""Which CUDA kernels a few model steps launch, for two trees: a refactor's check that the GPU path
did not change.

    python3 benchmarks/gpu/same_kernels.py trace TREE OUT.json   # TREE holds pagedllm/ and tests/
    python3 benchmarks/gpu/same_kernels.py compare OLD.json NEW.json

``trace`` runs tiny llama / qwen2 / qwen3 models and one- or two-layer Qwen3-0.6B and Llama-3.1-8B
shapes (random bf16 weights, eager, the Triton backend) through steps of 1, 2, 3 and 4+ token rows
and mixed prefill, and records each step's kernel names (torch profiler) and a digest of its
logits. ``compare`` prints, per step, whether the kernel sequences and the logits are the same.
"""

from __future__ import annotations

import json
import sys

STEPS = [
    [(0, list(range(3, 14))), (1, list(range(20, 27))), (2, list(range(40, 45)))],
    [(0, [100])],
    [(0, [101]), (1, [102])],
    [(0, [103]), (1, [104]), (2, [105])],
    [(0, [106, 107, 108, 109])],
]


def _prepare(model):
    import torch

    try:
        from pagedllm.config import KernelConfig
        from pagedllm.layers.dispatch import prepare_model_kernels
    except ImportError:  # a tree from before the op dispatch
        model.fold_norms()
        return
    prepare_model_kernels(model, torch.device("cuda"), KernelConfig())


def trace(tree: str, out_path: str) -> None:
    sys.path.insert(0, tree)
    import torch
    from transformers import AutoConfig

    from pagedllm.attention.triton_backend import TritonBackend
    from pagedllm.models import build_model, init_dummy_weights
    from tests.helpers import PagedTestRunner, tiny_config

    def configs():
        for arch in ("llama", "qwen2", "qwen3"):
            yield arch, tiny_config(arch)
        for name, layers in (("qwen3-0.6b", 2), ("llama-3.1-8b", 1)):
            cfg = AutoConfig.from_pretrained(f"benchmarks/configs/{name}")
            cfg.num_hidden_layers = layers
            yield name, cfg

    out = {}
    for name, cfg in configs():
        model = init_dummy_weights(build_model(cfg, torch.bfloat16, "cuda"), seed=3, std=0.02)
        _prepare(model)
        runner = PagedTestRunner(model, num_blocks=256, block_size=16, backend=TritonBackend())
        for i, chunks in enumerate(STEPS):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                logits = torch.cat(runner.step(chunks))
                torch.cuda.synchronize()
            kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            out[f"{name}/{i}"] = {"kernels": kernels, "logits_sum": float(logits.double().sum()),
                                  "logits_head": logits[:, :8].float().tolist()}
    with open(out_path, "w") as f:
        json.dump(out, f)


def compare(old_path: str, new_path: str) -> int:
    import difflib

    with open(old_path) as f:
        old = json.load(f)
    with open(new_path) as f:
        new = json.load(f)
    same_everywhere = True
    for key, a in old.items():
        b = new[key]
        same_kernels = a["kernels"] == b["kernels"]
        same_logits = a["logits_sum"] == b["logits_sum"] and a["logits_head"] == b["logits_head"]
        same_everywhere &= same_kernels
        logits = "SAME" if same_logits else f"DIFF {a['logits_sum']:.6g} vs {b['logits_sum']:.6g}"
        print(f"{key:20s} kernels {'SAME' if same_kernels else 'DIFF'} "
              f"({len(a['kernels'])} / {len(b['kernels'])}) logits {logits}")
        if not same_kernels:
            for line in list(difflib.unified_diff(a["kernels"], b["kernels"], lineterm=""))[:30]:
                print("    ", line[:150])
    print("ALL SAME KERNELS" if same_everywhere else "KERNEL DIFFERENCES")
    return 0 if same_everywhere else 1


if __name__ == "__main__":
    if sys.argv[1] == "trace":
        trace(sys.argv[2], sys.argv[3])
    else:
        sys.exit(compare(sys.argv[2], sys.argv[3]))
