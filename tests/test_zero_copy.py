"""Zero-copy transfers: a kernel reads and writes pinned host memory directly (pagedllm/zero_copy.py)."""

import pytest
import torch

from pagedllm import zero_copy


def test_unavailable_off_cuda():
    assert not zero_copy.available(torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not zero_copy.HAS_TRITON, reason="needs CUDA and Triton")
@pytest.mark.parametrize("n", [1, 37, 1024, 1025, 8192 + 3])
def test_kernel_copies_between_pinned_host_and_device(n):
    assert zero_copy.available(torch.device("cuda"))
    host = torch.randint(-2**62, 2**62, (n + 1,), dtype=torch.int64).pin_memory()
    dev = torch.full((n + 1,), -7, dtype=torch.int64, device="cuda")
    zero_copy.copy_words(host[:n], dev[:n])
    back = torch.zeros(n + 1, dtype=torch.int64).pin_memory()
    zero_copy.copy_words(dev[:n], back[:n])
    torch.cuda.synchronize()
    assert torch.equal(dev[:n].cpu(), host[:n]) and dev[n].item() == -7, "exactly n words are written"
    assert torch.equal(back[:n], host[:n]) and back[n].item() == 0
