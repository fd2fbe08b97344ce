"""Chunked lm_head + log-softmax against the full-logits naive twin, float64."""

import pytest
import torch
from torch import nn

from longstraw.logprobs import token_logprobs
from longstraw.ops.naive import naive_token_logprobs


@pytest.mark.parametrize("r,chunk,temp", [(1, 4, 1.0), (11, 4, 0.7), (8, 8, 1.3), (5, 100, 1.0)])
def test_matches_naive_values_and_grads(r, chunk, temp):
    torch.manual_seed(r)
    head = nn.Linear(6, 13, bias=True).double()
    hidden = torch.randn(r, 6, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 13, (r,))
    upstream = torch.randn(r, dtype=torch.float64)
    got = token_logprobs(head, hidden, targets, temperature=temp, chunk_size=chunk)
    g_got = torch.autograd.grad(got, (hidden, head.weight, head.bias), upstream)
    want = naive_token_logprobs(hidden, head.weight, targets, temp, head.bias)
    g_want = torch.autograd.grad(want, (hidden, head.weight, head.bias), upstream)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_only_the_chunk_inputs_are_saved_for_backward():
    """Activation checkpointing per chunk: backward keeps each chunk's hidden states and
    targets, nothing vocabulary-sized (no logits, no log-softmax), whatever the number of
    chunks. (Without checkpointing every chunk would keep [chunk, vocab] tensors: this
    test fails then; checked by removing the `checkpoint` call.)"""
    head = nn.Linear(8, 1000, bias=False)
    hidden = torch.randn(64, 8, requires_grad=True)
    targets = torch.randint(0, 1000, (64,))
    saved = []

    def pack(t):
        if t.untyped_storage().data_ptr() != head.weight.untyped_storage().data_ptr():  # the weight is held anyway
            saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_logprobs(head, hidden, targets, chunk_size=16)
    assert sum(saved) <= hidden.numel() + targets.numel(), saved
