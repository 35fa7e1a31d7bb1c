"""The parallel layers at one rank are the plain layers; at several ranks (simulated in one
process: each rank's layer built under its own group, the collectives done by the test) each rank
loads its slice of the checkpoint tensors and the ranks' outputs combine into the unsharded result."""

import pytest
import torch
import torch.nn.functional as F

from pagedllm.distributed import TensorParallelGroup, get_tp_group, set_tp_group
from pagedllm.layers import ColumnParallelLinear, MergedLinear, QKVLinear, RowParallelLinear
from pagedllm.layers.embedding import LMHead, VocabEmbedding


class LocalRank(TensorParallelGroup):
    """A rank of a simulated group: collectives are left to the test (identity here)."""

    def all_reduce(self, x):
        return x

    def all_gather(self, x, dim=-1):
        return x


def build_ranks(size, make):
    layers = []
    for rank in range(size):
        previous = set_tp_group(LocalRank(rank, size))
        try:
            layers.append(make())
        finally:
            set_tp_group(previous)
    return layers


def load(layer, **tensors):
    params = dict(layer.named_parameters())
    for name, (tensor, shard) in tensors.items():
        param = params[name.split(":")[0]]
        param.weight_loader(param, tensor, shard)


torch.manual_seed(0)
X = torch.randn(3, 8)


def test_one_rank_is_the_default_group():
    assert get_tp_group().size == 1 and get_tp_group().all_reduce(X) is X


def test_column_parallel_ranks_concatenate_to_the_full_output():
    w, b = torch.randn(6, 8), torch.randn(6)
    ranks = build_ranks(2, lambda: ColumnParallelLinear(8, 6, bias=True))
    for layer in ranks:
        load(layer, weight=(w, None), bias=(b, None))
    assert torch.allclose(torch.cat([layer(X) for layer in ranks], dim=-1), F.linear(X, w, b), atol=1e-6)


def test_row_parallel_ranks_sum_to_the_full_output_with_the_bias_once():
    w, b = torch.randn(5, 8), torch.randn(5)
    ranks = build_ranks(2, lambda: RowParallelLinear(8, 5, bias=True))
    for layer in ranks:
        load(layer, weight=(w, None), bias=(b, None))
    partial = [layer(X[:, 4 * r: 4 * r + 4]) for r, layer in enumerate(ranks)]
    assert torch.allclose(partial[0] + partial[1], F.linear(X, w, b), atol=1e-5)
    residual = torch.zeros(3, 5)  # the residual-stream add sees the reduced sum, never a partial one
    assert torch.allclose(ranks[0].forward_add_(X[:, :4], residual), partial[0])


def test_merged_projections_split_each_projection():
    gate, up = torch.randn(6, 8), torch.randn(6, 8)
    ranks = build_ranks(2, lambda: MergedLinear(8, [6, 6]))
    for layer in ranks:
        load(layer, **{"weight": (gate, 0), "weight:up": (up, 1)})
    outs = [layer(X) for layer in ranks]
    assert torch.allclose(torch.cat([o[:, :3] for o in outs], -1), X @ gate.T, atol=1e-6)
    assert torch.allclose(torch.cat([o[:, 3:] for o in outs], -1), X @ up.T, atol=1e-6)
    merged = build_ranks(2, lambda: MergedLinear(8, [6, 6]))  # a checkpoint with the merged tensor
    for layer in merged:
        load(layer, weight=(torch.cat([gate, up]), None))
    assert all(torch.equal(a.weight, b.weight) for a, b in zip(ranks, merged))


@pytest.mark.parametrize("size,num_kv_heads", [(2, 2), (4, 2), (2, 4)])
def test_qkv_heads_split_and_kv_heads_replicated_where_fewer_than_ranks(size, num_kv_heads):
    head_dim, num_heads = 2, 4
    q, k, v = torch.randn(num_heads * head_dim, 8), torch.randn(num_kv_heads * head_dim, 8), torch.randn(
        num_kv_heads * head_dim, 8)
    ranks = build_ranks(size, lambda: QKVLinear(8, head_dim, num_heads, num_kv_heads))
    for rank, layer in enumerate(ranks):
        load(layer, **{"weight": (q, "q"), "weight:k": (k, "k"), "weight:v": (v, "v")})
        assert layer.num_heads == num_heads // size
        local_q, local_k, _ = layer(X).split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
        assert torch.allclose(local_q, (X @ q.T)[:, rank * layer.q_size:(rank + 1) * layer.q_size], atol=1e-6)
        kv_head = rank * num_kv_heads // size
        expected_k = (X @ k.T).view(3, num_kv_heads, head_dim)[:, kv_head: kv_head + layer.num_kv_heads]
        assert torch.allclose(local_k, expected_k.reshape(3, -1), atol=1e-6)


def test_sizes_that_do_not_divide_are_refused_by_name():
    with pytest.raises(ValueError, match="num_attention_heads"):
        build_ranks(2, lambda: QKVLinear(576, 64, 9, 3))  # SmolLM2-135M at tp=2
    with pytest.raises(ValueError, match="vocab_size"):
        build_ranks(2, lambda: VocabEmbedding(7, 4))
    with pytest.raises(ValueError, match="input features"):
        build_ranks(2, lambda: RowParallelLinear(7, 4))


def test_vocab_parallel_embedding_and_lm_head():
    table = torch.randn(10, 4)
    ids = torch.tensor([0, 4, 5, 9])
    embeds = build_ranks(2, lambda: VocabEmbedding(10, 4))
    heads = build_ranks(2, lambda: LMHead(10, 4))
    for embed, head in zip(embeds, heads):
        load(embed, weight=(table, None))
        load(head, weight=(table, None))
    assert torch.equal(embeds[0](ids) + embeds[1](ids), F.embedding(ids, table))
    hidden = torch.randn(2, 4)
    logits = torch.cat([head(hidden) for head in heads], dim=-1)
    assert torch.allclose(logits, hidden @ table.T, atol=1e-6)
