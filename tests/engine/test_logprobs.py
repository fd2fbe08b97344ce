"""Chunked lm_head + log-softmax against the full-logits naive twin, float64."""

import pytest
import torch
from torch import nn

from longstraw.engine.logprobs import token_logprobs
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


# ----------------------------------------------------------------------------
# half precision: cast to float32 first, then divide by the temperature (as the sampler does)


def test_bf16_logits_are_cast_before_the_temperature_divides_them():
    """bf16 logits of magnitude ~10 carry steps of 2^-4; dividing them by T in bf16
    rounds each again (measured 0.19 nats off at T = 0.7, vocab 32,000). Cast first:
    the result is then log softmax(float32(logits) / T) up to float32 rounding."""
    from longstraw.engine.logprobs import scaled_log_softmax

    torch.manual_seed(0)
    logits = (4 * torch.randn(4, 32000)).to(torch.bfloat16)
    for temp in (0.7, 1.3):
        want = torch.log_softmax(logits.double() / temp, dim=-1)
        got = scaled_log_softmax(logits, temp)
        assert got.dtype == torch.float32
        assert (got.double() - want).abs().max() < 1e-4, temp


def test_bf16_token_logprobs_match_the_sampled_distribution():
    """Chunked token log-probs of a bf16 lm_head equal log softmax(float32 logits / T),
    the distribution `sample_tokens` draws from, and the naive twin agrees."""
    torch.manual_seed(1)
    head = nn.Linear(8, 4000, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        head.weight.mul_(40)  # logits ~ 10: bf16's rounding of logits / T would show
    hidden = torch.randn(6, 8).to(torch.bfloat16)
    targets = torch.randint(0, 4000, (6,))
    with torch.no_grad():
        got = token_logprobs(head, hidden, targets, temperature=0.7, chunk_size=4)
        want = torch.log_softmax(head(hidden).double() / 0.7, dim=-1).gather(-1, targets[:, None])[:, 0]
        naive = naive_token_logprobs(hidden, head.weight, targets, 0.7)
    assert (got.double() - want).abs().max() < 1e-4
    assert (naive.double() - want).abs().max() < 1e-4
