"""The physical floor of a benchmark: bytes that must move over measured copy bandwidth, FLOPs
over measured matmul rate; the larger of the two is the floor (DESIGN.md "Performance").

Decode model: every request produces its first token from the prefill; each later token is one
decode step that reads all weights once (shared by the batch) and the request's whole KV so far.
"""

from __future__ import annotations

import datetime
import subprocess
from dataclasses import asdict, dataclass

from pagedllm import envs


@dataclass
class Floor:
    weight_bytes_moved: float
    kv_read_bytes: float
    kv_write_bytes: float
    flops: float
    copy_bytes_per_s: float
    matmul_flops_per_s: float

    @property
    def bytes_moved(self) -> float:
        return self.weight_bytes_moved + self.kv_read_bytes + self.kv_write_bytes

    @property
    def bytes_seconds(self) -> float:
        return self.bytes_moved / self.copy_bytes_per_s

    @property
    def flops_seconds(self) -> float:
        return self.flops / self.matmul_flops_per_s

    @property
    def seconds(self) -> float:
        return max(self.bytes_seconds, self.flops_seconds)

    def as_dict(self) -> dict:
        return {**asdict(self), "bytes_moved": self.bytes_moved, "bytes_seconds": self.bytes_seconds,
                "flops_seconds": self.flops_seconds, "floor_seconds": self.seconds}


@dataclass
class ModelShape:
    num_params: int  # every parameter (an embedding tied to the head counts once)
    embedding_params: int
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    kv_dtype_bytes: int | None = None  # the KV cache's element size (None: dtype_bytes; 1 for fp8)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * (self.kv_dtype_bytes or self.dtype_bytes)

    @classmethod
    def from_model(cls, model, hf_config, dtype_bytes: int, kv_dtype_bytes: int | None = None) -> ModelShape:
        c = hf_config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return cls(
            num_params=sum(p.numel() for p in model.parameters()),
            embedding_params=c.vocab_size * c.hidden_size, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
            num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads, head_dim=head_dim,
            dtype_bytes=dtype_bytes, kv_dtype_bytes=kv_dtype_bytes,
        )


def generation_floor(shape: ModelShape, prompt_lens: list[int], output_lens: list[int],
                     copy_bytes_per_s: float, matmul_flops_per_s: float) -> Floor:
    kv = shape.kv_bytes_per_token
    decode_steps = max(output_lens) - 1
    kv_reads = sum(p * (o - 1) + (o - 1) * o // 2 for p, o in zip(prompt_lens, output_lens)) * kv
    kv_writes = sum(p + o for p, o in zip(prompt_lens, output_lens)) * kv
    tokens = sum(prompt_lens) + sum(output_lens)
    dense = 2 * (shape.num_params - shape.embedding_params) * tokens + 2 * shape.hidden_size * shape.vocab_size * sum(output_lens)
    attn_per_ctx = 4 * shape.num_layers * shape.num_heads * shape.head_dim  # QK^T and PV per (query, key)
    ctx_pairs = sum(p * (p + 1) // 2 + p * (o - 1) + (o - 1) * o // 2 for p, o in zip(prompt_lens, output_lens))
    return Floor(
        weight_bytes_moved=float(shape.num_params * shape.dtype_bytes * decode_steps),
        kv_read_bytes=float(kv_reads), kv_write_bytes=float(kv_writes),
        flops=float(dense + attn_per_ctx * ctx_pairs),
        copy_bytes_per_s=copy_bytes_per_s, matmul_flops_per_s=matmul_flops_per_s,
    )


def measure_copy_bandwidth(device, nbytes: int = 2**30, iters: int = 20) -> float:
    """Device-to-device copy rate, counting bytes read plus bytes written."""
    import torch

    x = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        y.copy_(x)
    end.record()
    end.synchronize()
    return 2 * nbytes * iters / (start.elapsed_time(end) / 1e3)


def measure_matmul_rate(device, n: int = 8192, iters: int = 10) -> float:
    import torch

    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        a @ b
    end.record()
    end.synchronize()
    return 2 * n**3 * iters / (start.elapsed_time(end) / 1e3)


def git_commit() -> str:
    """The commit measured: ``PAGEDLLM_COMMIT`` if set (a copy of the tree whose ``.git`` lags behind
    it, as on a lent GPU machine), else ``git rev-parse --short HEAD``, suffixed ``+dirty`` when
    tracked files differ from it."""
    if envs.PAGEDLLM_COMMIT:
        return envs.PAGEDLLM_COMMIT
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                 text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head}+dirty" if changed else head


def today() -> str:
    return datetime.date.today().isoformat()


def device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if str(device).startswith("cuda") else "cpu"
