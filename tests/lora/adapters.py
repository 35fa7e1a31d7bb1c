"""Tiny PEFT LoRA adapters over the tiny random Llama of ``tests/helpers.py``, and the
transformers + PEFT reference they are compared with."""

from __future__ import annotations

import os

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(base: str, folder: str | os.PathLike, seed: int, rank: int = 8, alpha: int = 16,
                 targets=ALL_TARGETS, use_rslora: bool = False, **extra) -> str:
    """A PEFT LoRA folder for the checkpoint at ``base`` with random A and B (B != 0, so it changes
    the outputs), saved as adapter_config.json + adapter_model.safetensors."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                        use_rslora=use_rslora, **extra)
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    peft_model.save_pretrained(str(folder))
    return str(folder)


def peft_greedy(base: str, adapter: str | None, prompts: list[list[int]], max_tokens: int,
                ) -> list[tuple[list[int], list[float]]]:
    """transformers (+ PEFT ``adapter``; None: the base model) greedy ids and each chosen token's
    logprob, one prompt at a time, float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    results = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, output_scores=True, return_dict_in_generate=True,
                                 pad_token_id=0)
        ids = out.sequences[0, len(prompt):].tolist()
        logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, ids)]
        results.append((ids, logprobs))
    return results
