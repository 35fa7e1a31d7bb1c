"""Tiny PEFT LoRA adapters over a tiny random Llama, and the transformers + PEFT reference that
checks our outputs (one teacher-forced forward per sequence: every generated token must be the
reference's argmax after the tokens before it, with the same logprob)."""

from __future__ import annotations

import os

import torch

from tests.helpers import TINY_INIT_STD, tiny_config

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_base_model(folder: str | os.PathLike, seed: int = 0) -> str:
    """The tiny random Llama of ``tests/helpers.py`` without a tokenizer (engines run with
    ``skip_tokenizer_init`` on token ids): quicker to write than ``make_tiny_model``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0, 0.1) if "norm" in name else param.normal_(0.0, TINY_INIT_STD)
    model.save_pretrained(str(folder))
    return str(folder)


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


class PeftReference:
    """transformers' model of ``base`` with PEFT ``adapters`` (name -> folder) loaded side by side."""

    def __init__(self, base: str, adapters: dict[str, str]) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        names = list(adapters)
        self.model = PeftModel.from_pretrained(model, adapters[names[0]], adapter_name=names[0])
        for name in names[1:]:
            self.model.load_adapter(adapters[name], adapter_name=name)
        self.model.eval()

    @torch.no_grad()
    def logprobs(self, adapter: str | None, token_ids: list[int]) -> torch.Tensor:
        """``[len - 1, vocab]`` log-probabilities of each next token (None: the base model)."""
        inputs = torch.tensor([token_ids])
        if adapter is None:
            with self.model.disable_adapter():
                logits = self.model(inputs).logits[0]
        else:
            self.model.set_adapter(adapter)
            logits = self.model(inputs).logits[0]
        return torch.log_softmax(logits[:-1].float(), dim=-1)

    def greedy(self, adapter: str | None, prompt: list[int], num_tokens: int) -> list[int]:
        """The reference's greedy continuation of ``prompt`` (one forward per token)."""
        ids = list(prompt)
        for _ in range(num_tokens):
            ids.append(int(self.logprobs(adapter, ids + [0])[-1].argmax()))
        return ids[len(prompt):]

    def check(self, adapter: str | None, prompt: list[int], output_ids: list[int], output_logprobs: list[float],
              atol: float = 1e-3) -> None:
        """Every output token is the reference's greedy choice, with the reference's logprob."""
        ref = self.logprobs(adapter, prompt + output_ids)[len(prompt) - 1 :]
        assert ref.argmax(-1).tolist() == output_ids, (adapter, prompt)
        chosen = ref[torch.arange(len(output_ids)), torch.tensor(output_ids)]
        assert torch.allclose(chosen, torch.tensor(output_logprobs), atol=atol), (adapter, chosen, output_logprobs)
