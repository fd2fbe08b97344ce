"""Reference implementations the tests (and benchmarks) compare against.

* `tiny_model`: stock Hugging Face causal LMs of each family, from configs in code.
* `hf_cached_logprobs`: HF's own cached continuation, the detached-mode reference:
  prompt[:-1] under no_grad into HF's cache, then [prompt[-1]] + response[:-1]
  with autograd on a deep copy of that cache.
* `hf_full_logprobs`: one full-sequence forward over prompt + response (the naive path).
* `reference_grpo_loss`: the GRPO group loss written out plainly from TRL's formulas,
  independently of `longstraw.grpo`.
"""

from __future__ import annotations

import copy

import torch
import transformers

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

_BASE = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, attention_dropout=0.0, initializer_range=0.2,
             tie_word_embeddings=False)
_EXTRA = {
    "llama": dict(attention_bias=True),
    "mistral": dict(sliding_window=None),
    "qwen2": dict(),
    "qwen3": dict(head_dim=12, attention_bias=False),
}
_CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
}


def tiny_config(family: str, **overrides):
    config_cls, _ = _CLASSES[family]
    kwargs = {**_BASE, **_EXTRA[family], **overrides}
    return config_cls(**kwargs)


def tiny_model(family: str, *, dtype=torch.float64, seed: int = 0, **overrides):
    """A stock HF model of `family` with random weights, eval mode, SDPA attention
    (HF's eager attention does its softmax in float32 even for float64 models)."""
    _, model_cls = _CLASSES[family]
    torch.manual_seed(seed)
    config = tiny_config(family, **overrides)
    config._attn_implementation = "sdpa"
    model = model_cls(config).to(dtype).eval()
    return model


def random_group(vocab: int, prompt_len: int, response_lens, *, seed: int = 0, rewards=None):
    import longstraw as ls

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (prompt_len,), generator=g)
    responses = [torch.randint(0, vocab, (r,), generator=g) for r in response_lens]
    if rewards is None:
        rewards = torch.rand(len(responses), generator=g, dtype=torch.float64)
    return ls.Group(prompt=prompt, responses=responses, rewards=torch.as_tensor(rewards, dtype=torch.float64))


def _gather_logprobs(logits, targets, temperature):
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, targets[:, None])[:, 0]


def hf_cached_logprobs(model, prompt, response, temperature=1.0):
    """HF's cached continuation: [R] log-probs, with graph when grad is enabled."""
    with torch.no_grad():
        cache = model(prompt[:-1][None], use_cache=True).past_key_values
    cache = copy.deepcopy(cache)
    inputs = torch.cat([prompt[-1:], response[:-1]])
    logits = model(inputs[None], past_key_values=cache, use_cache=True).logits[0]
    return _gather_logprobs(logits, response, temperature)


def hf_full_logprobs(model, prompt, response, temperature=1.0):
    """One full-sequence forward over prompt + response: [R] log-probs of the response."""
    ids = torch.cat([prompt, response])
    logits = model(ids[None], logits_to_keep=response.numel() + 1).logits[0, :-1]
    return _gather_logprobs(logits, response, temperature)


def reference_grpo_loss(logps, group, *, loss_type="dapo", epsilon_low=0.2, epsilon_high=0.2, beta=0.0,
                        scale_rewards="group", max_completion_length=None, num_sequences=None, num_tokens=None):
    """TRL's GRPO loss over one group, from the formulas (not from longstraw.grpo)."""
    r = group.rewards.to(torch.float64)
    adv = r - r.mean()
    if scale_rewards == "group":
        adv = adv / (r.std() + 1e-4)
    if bool(r.max() == r.min()):
        adv = torch.zeros_like(adv)
    per_seq = []
    for i, logp in enumerate(logps):
        old = logp.detach() if group.old_logprobs is None else group.old_logprobs[i]
        c1 = torch.exp(logp - old)
        c2 = torch.clamp(c1, 1 - epsilon_low, 1 + epsilon_high)
        tok = -torch.min(c1 * adv[i], c2 * adv[i])
        if beta > 0:
            ref = group.ref_logprobs[i]
            tok = tok + beta * (torch.exp(ref - logp) - (ref - logp) - 1)
        per_seq.append(tok)
    n_seq = num_sequences or len(logps)
    if loss_type == "dapo":
        return torch.cat(per_seq).sum() / (num_tokens or sum(t.numel() for t in per_seq))
    if loss_type == "grpo":
        return torch.stack([t.mean() for t in per_seq]).sum() / n_seq
    max_len = max_completion_length or max(t.numel() for t in per_seq)
    return torch.cat(per_seq).sum() / (n_seq * max_len)


def grads_of(model):
    return {n: (p.grad.detach().clone() if p.grad is not None else None) for n, p in model.named_parameters()}


def assert_grads_close(got: dict, want: dict, rel: float = 1e-9):
    """Every parameter: ||got - want|| <= rel * ||want|| (exact zero where want is 0)."""
    assert got.keys() == want.keys()
    for name in want:
        g, w = got[name], want[name]
        if w is None or g is None:
            assert g is None and w is None or (g if w is None else w).abs().max() == 0, name
            continue
        scale = w.norm()
        err = (g - w).norm()
        assert err <= rel * scale + 1e-300, f"{name}: rel err {float(err / scale) if scale > 0 else float(err):.3e}"


def assert_loss_close(got: float, want: float, rel: float = 1e-9):
    """Relative, with an absolute floor for losses that are ~0 (on-policy, zero-mean advantages)."""
    assert abs(got - want) <= rel * abs(want) + 1e-13, (got, want)


def _float64_rms_norm(self, hidden_states):
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def float64_norms(model):
    """Make the model's RMSNorms compute in the input dtype instead of float32.

    Stock HF RMSNorm casts to float32 and back, so in a float64 model every gradient
    that crosses a norm is rounded to float32. The detached reference is unaffected
    (both sides round identically), but exact mode sums a prompt token's gradient over
    branches *before* that rounding while per-branch autograd rounds each branch's
    share, so they can only agree to float32 precision (~1e-7). Patching the norm in
    both the engine's and the reference's model (the same instance) keeps the
    comparison at float64 precision. Only llama-style norms (weight * x_hat).
    """
    import types

    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_float64_rms_norm, module)
    return model
