"""Peers run in the same process as our engine: transformers ``generate()`` (padded batches) and
``generate_batch()`` (its continuous batching), on the same weights and the same requests."""

from __future__ import annotations

import json
import os
import time

from pagedllm.entrypoints.bench_workload import Workload


def build_random_checkpoint(config_folder: str, out_folder: str, seed: int = 0) -> str:
    """A random bf16 checkpoint of the architecture in ``config_folder`` (as the vLLM anchor
    scripts build theirs), saved as safetensors so every engine loads identical weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if os.path.isfile(os.path.join(out_folder, "config.json")) and any(
        f.endswith(".safetensors") for f in os.listdir(out_folder)
    ):
        return out_folder
    os.makedirs(out_folder, exist_ok=True)
    with open(os.path.join(config_folder, "config.json")) as f:
        raw = json.load(f)
    config = AutoConfig.from_pretrained(config_folder)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out_folder, max_shard_size="4GB")
    with open(os.path.join(out_folder, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    del model
    torch.cuda.empty_cache()
    return out_folder


def _load(folder: str, attn: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, attn_implementation=attn).cuda().eval()


def generate_padded(model, wl: Workload, batch_size: int, pad_id: int) -> tuple[float, int]:
    """transformers generate() with left-padded batches sorted by prompt length (greedy)."""
    import torch

    order = sorted(range(len(wl.prompts)), key=lambda i: len(wl.prompts[i]))
    device = next(model.parameters()).device
    counted = 0
    t0 = time.perf_counter()
    for b in range(0, len(order), batch_size):
        idx = order[b : b + batch_size]
        width = max(len(wl.prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            p = wl.prompts[i]
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        steps = max(wl.max_tokens[i] for i in idx)
        with torch.inference_mode():
            model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=steps,
                           min_new_tokens=steps, do_sample=False, pad_token_id=pad_id)
        counted += sum(wl.max_tokens[i] for i in idx)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, counted


def run_hf_generate(folder: str, prompts: list[list[int]], max_tokens: list[int], batch_size: int) -> dict:
    """Padded batches sorted by prompt length, each run to its longest max_tokens; only the tokens
    each request asked for are counted."""
    import torch

    model = _load(folder, "sdpa")
    seconds, tokens = generate_padded(model, Workload(prompts, max_tokens), batch_size, pad_id=0)
    del model
    torch.cuda.empty_cache()
    return {"peer": "hf generate", "requests": len(prompts), "batch_size": batch_size, "output_tokens": tokens,
            "seconds": seconds, "output_tokens_per_s": tokens / seconds}


def run_hf_generate_batch(folder: str, prompts: list[list[int]], max_tokens: list[int]) -> dict:
    """transformers' continuous batching (paged|sdpa). It takes one max_new_tokens for the whole
    call, so every request runs to the longest; every generated token is counted."""
    import torch
    from transformers import GenerationConfig

    model = _load(folder, "paged|sdpa")
    gen = GenerationConfig(max_new_tokens=max(max_tokens), do_sample=False, eos_token_id=-1, pad_token_id=0)
    model.generate_batch(inputs=[prompts[0]], generation_config=GenerationConfig(max_new_tokens=4, do_sample=False,
                         eos_token_id=-1, pad_token_id=0), progress_bar=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    results = model.generate_batch(inputs=prompts, generation_config=gen, progress_bar=False)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    tokens = sum(len(r.generated_tokens) for r in results.values())
    del model
    torch.cuda.empty_cache()
    return {"peer": "hf generate_batch (paged|sdpa)", "requests": len(prompts), "max_new_tokens": max(max_tokens),
            "output_tokens": tokens, "seconds": seconds, "output_tokens_per_s": tokens / seconds}
