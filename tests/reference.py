"""Reference implementations the tests (and benchmarks) compare against.

* `tiny_model`: stock Hugging Face causal LMs of each family, from configs in code.
* `hf_cached_logprobs`: HF's own cached continuation, the detached-mode reference:
  prompt[:-1] under no_grad into HF's cache, then [prompt[-1]] + response[:-1]
  with autograd on a deep copy of that cache.
* `hf_full_logprobs`: one full-sequence forward over prompt + response (the naive path).
* `uniform_group`: the benchmarks' random group (G responses of one length).
* `reference_grpo_loss`: the GRPO group loss written out plainly from TRL's formulas,
  independently of `longstraw.grpo`, with TRL's `tool_mask` when the group has loss masks.
* `masked_group`: a `random_group` with loss masks (context-only runs inside responses).
* `tree_group`: a group whose responses share segments (prefix trees).
"""

from __future__ import annotations

import contextlib
import copy
import importlib

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


def masked_group(vocab: int, prompt_len: int, response_lens, *, seed: int = 0, rewards=None):
    """`random_group` with loss masks: each response of 3+ tokens gets a context-only
    run (an observation) inside it, first and last token kept; the shorter ones keep
    every token. The masks are made from `seed` too."""
    group = random_group(vocab, prompt_len, response_lens, seed=seed, rewards=rewards)
    g = torch.Generator().manual_seed(seed + 1)
    masks = []
    for r in response_lens:
        m = torch.ones(r, dtype=torch.bool)
        if r >= 3:
            a = int(torch.randint(1, r - 1, (1,), generator=g))
            b = int(torch.randint(a + 1, r, (1,), generator=g))  # [a, b) masked, 1 <= a < b <= r - 1
            m[a:b] = False
        masks.append(m)
    group.loss_masks = masks
    return group


def uniform_group(vocab_size: int, prompt_tokens: int, group_size: int, response_tokens: int, *, seed: int = 0):
    """A `Group` of random token ids (prompt [P], G responses of one length [R]) with
    random float32 rewards in [0, 1): the benchmarks' group (was `longstraw.tiny.random_group`)."""
    import longstraw as ls

    g = torch.Generator().manual_seed(seed)
    return ls.Group(
        prompt=torch.randint(0, vocab_size, (prompt_tokens,), generator=g),
        responses=[torch.randint(0, vocab_size, (response_tokens,), generator=g) for _ in range(group_size)],
        rewards=torch.rand(group_size, generator=g),
    )


def gather_logprobs(logits, targets, temperature):
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, targets[:, None])[:, 0]


def _out_of_place_linear_cache(cache):
    """HF's linear-attention cache layers write states with in-place `copy_`, which
    breaks autograd through a replayed branch. Rebind the copy's update methods to
    assign new tensors instead (same values), and route single-token steps through
    the same path (`record_past`), so HF's own GDN forward can be differentiated."""
    import types

    def update_conv_state(self, conv_states, state_idx=0, conv_kernel_size=None, **kwargs):
        full = torch.cat([self.conv_states[state_idx], conv_states], dim=-1)
        self.conv_states[state_idx] = full[..., -self.conv_kernel_size[state_idx]:]
        return full

    def update_recurrent_state(self, recurrent_states, state_idx=0, **kwargs):
        self.recurrent_states[state_idx] = recurrent_states
        return recurrent_states

    for layer in getattr(cache, "layers", []):
        if hasattr(layer, "recurrent_states"):
            layer.update_conv_state = types.MethodType(update_conv_state, layer)
            layer.update_recurrent_state = types.MethodType(update_recurrent_state, layer)
            layer.record_past = True
    return cache


def hf_cached_logprobs(model, prompt, response, temperature=1.0):
    """HF's cached continuation: [R] log-probs, with graph when grad is enabled."""
    with torch.no_grad():
        cache = model(prompt[:-1][None], use_cache=True).past_key_values
    cache = _out_of_place_linear_cache(copy.deepcopy(cache))
    inputs = torch.cat([prompt[-1:], response[:-1]])
    logits = model(inputs[None], past_key_values=cache, use_cache=True).logits[0]
    return gather_logprobs(logits, response, temperature)


def hf_full_logprobs(model, prompt, response, temperature=1.0):
    """One full-sequence forward over prompt + response: [R] log-probs of the response."""
    ids = torch.cat([prompt, response])
    logits = model(ids[None], logits_to_keep=response.numel() + 1).logits[0, :-1]
    return gather_logprobs(logits, response, temperature)


def reference_grpo_loss(logps, group, *, loss_type="dapo", epsilon_low=0.2, epsilon_high=0.2, beta=0.0,
                        scale_rewards="group", max_completion_length=None, num_sequences=None, num_tokens=None):
    """TRL's GRPO loss over one group, from the formulas (not from longstraw.grpo).

    With `group.loss_masks`, TRL's `_compute_loss` with `mask = completion_mask * tool_mask`:
    masked tokens are multiplied out of every sum and counted in no token count (each
    count clamped to 1); `group.advantages`, when set, replace the computed ones."""
    if group.advantages is not None:
        adv = group.advantages.to(torch.float64)
    else:
        r = group.rewards.to(torch.float64)
        adv = r - r.mean()
        if scale_rewards == "group":
            adv = adv / (r.std() + 1e-4)
        if bool(r.max() == r.min()):
            adv = torch.zeros_like(adv)
    masks = group.loss_masks or [torch.ones(t.numel(), dtype=torch.bool) for t in logps]
    per_seq = []
    for i, logp in enumerate(logps):
        old = logp.detach() if group.old_logprobs is None else group.old_logprobs[i]
        c1 = torch.exp(logp - old)
        c2 = torch.clamp(c1, 1 - epsilon_low, 1 + epsilon_high)
        tok = -torch.min(c1 * adv[i], c2 * adv[i])
        if beta > 0:
            ref = group.ref_logprobs[i]
            tok = tok + beta * (torch.exp(ref - logp) - (ref - logp) - 1)
        per_seq.append(tok * masks[i].to(tok))
    n_seq = num_sequences or len(logps)
    counts = [float(m.sum()) for m in masks]
    if loss_type == "dapo":
        return torch.cat(per_seq).sum() / (num_tokens or max(1.0, sum(counts)))
    if loss_type == "grpo":
        return torch.stack([t.sum() / max(1.0, c) for t, c in zip(per_seq, counts)]).sum() / n_seq
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


# ----------------------------------------------------------------------------
# hybrid recurrent + attention families (Qwen3.5 / 3.6, Qwen3.5-MoE, Qwen3-Next)

HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
_HYBRID = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4, max_position_embeddings=512,
               layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
               tie_word_embeddings=False, initializer_range=0.2, attention_dropout=0.0)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)


def tiny_hybrid(family: str, *, dtype=torch.float64, seed: int = 0, **overrides):
    """A stock HF hybrid causal LM (2+ GDN layers and one full-attention layer)."""
    if family == "qwen3_5":
        config_cls, model_cls, extra = transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM, {}
    elif family == "qwen3_5_moe":
        config_cls, model_cls, extra = transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM, _MOE
    else:
        config_cls, model_cls, extra = transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM, _MOE
    config = config_cls(**{**_HYBRID, **extra, **overrides})
    config._attn_implementation = "sdpa"
    config._experts_implementation = "eager"  # torch's grouped_mm takes no float64
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype).eval()
    with torch.no_grad():  # HF initialises some norm weights / A_log to constants; randomise them
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _hf_gdn_float64(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=False, **kwargs):
    """HF's gated-delta-rule signature ([B, T, H, D]) on our float64 naive twin."""
    from longstraw.ops.naive import naive_gated_delta_rule

    outs, finals = [], []
    for i in range(query.shape[0]):
        h0 = None if initial_state is None else initial_state[i]
        o, s = naive_gated_delta_rule(query[i], key[i], value[i], g[i].to(value.dtype), beta[i].to(value.dtype), h0,
                                      use_qk_l2norm=use_qk_l2norm_in_kernel)
        outs.append(o)
        finals.append(s)
    return torch.stack(outs), (torch.stack(finals) if output_final_state else None)


def _norm_1p(self, x):  # Qwen3.5 / Qwen3-Next RMSNorm: x_hat * (1 + w), in x's dtype
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def _norm_gated(self, x, gate):  # gated RMSNorm: w * x_hat * silu(gate), in x's dtype
    x_hat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * x_hat * torch.nn.functional.silu(gate)


def float64_hybrid_norms(model):
    """Make a hybrid model's RMSNorms and gated norms compute in the input dtype, for the
    model's lifetime (`float64_hybrid`'s norms, without its HF-kernel patch: the engine
    never calls HF's GDN kernel). Stock HF's gated norm applies silu in float32, and
    torch's CPU silu rounds a row by where it falls in the batch (vectorised body or
    scalar tail), so two engines that batch the same tokens differently (a divided
    capture's own rows vs a chunk) can only agree to float32 precision (~1e-7)."""
    _patch_norms(model)
    return model


def _patch_norms(model) -> list:
    """Point every RMSNorm and gated norm of `model` at the input-dtype versions above;
    returns the patched modules (`del module.forward` undoes each)."""
    import types

    patched = []
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RMSNormGated"):
            module.forward = types.MethodType(_norm_gated, module)
        elif name.endswith("RMSNorm") and hasattr(module, "eps"):
            module.forward = types.MethodType(_norm_1p, module)
        else:
            continue
        patched.append(module)
    return patched


@contextlib.contextmanager
def float64_hybrid(model):
    """Run a hybrid model's HF internals in float64 where stock HF computes in float32
    (the GDN kernel, and the RMSNorms and gated norms). Same maths; it lets the
    engine be compared with HF at float64 precision. The engine does not call HF's
    GDN kernel, so only the reference side changes there; the norms are shared."""
    modules = [importlib.import_module(f"transformers.models.{m}.modeling_{m}") for m in HYBRID_FAMILIES]
    kernels = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
    saved = [(m, name, getattr(m, name)) for m in modules for name in kernels]
    for m, name, _ in saved:
        setattr(m, name, _hf_gdn_float64)
    patched = _patch_norms(model)
    try:
        yield model
    finally:
        for m, name, fn in saved:
            setattr(m, name, fn)
        for module in patched:
            del module.forward


# ----------------------------------------------------------------------------
# MLA (+ DSA) families: GLM-5.x, DeepSeek-V3.2, DeepSeek-V3

MLA_FAMILIES = ("glm_moe_dsa", "deepseek_v32", "deepseek_v3")
_MLA = dict(vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
            qk_nope_head_dim=12, v_head_dim=10, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            first_k_dense_replace=1, n_group=1, topk_group=1, max_position_embeddings=512, initializer_range=0.2,
            tie_word_embeddings=False, attention_dropout=0.0)
_DSA = dict(index_head_dim=16, index_n_heads=16, index_topk=8)


def tiny_mla(family: str, *, dtype=torch.float64, seed: int = 0, **overrides):
    """A stock HF MLA model; DSA families get 16 indexer heads (no exact score ties)."""
    classes = {
        "glm_moe_dsa": (transformers.GlmMoeDsaConfig, transformers.GlmMoeDsaForCausalLM,
                        dict(_DSA, indexer_types=["full", "shared", "full"])),
        "deepseek_v32": (transformers.DeepseekV32Config, transformers.DeepseekV32ForCausalLM, _DSA),
        "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM, dict(rope_interleave=True)),
    }
    config_cls, model_cls, extra = classes[family]
    config = config_cls(**{**_MLA, **extra, **overrides})
    config._attn_implementation = "sdpa"
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype).eval()
    with torch.no_grad():  # e_score_correction_bias etc. start at constants; randomise 1-D params
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def compare_step(model, group, exec_cfg, reference_logprobs, rel, grpo=None):
    """Engine.step against the reference GRPO loss over `reference_logprobs` (HF's
    cached continuation or full sequence): loss and every parameter gradient. `grpo`:
    a `GRPOConfig` (default: the default one), mirrored in the reference loss."""
    import longstraw as ls

    grpo = ls.GRPOConfig() if grpo is None else grpo
    model.zero_grad(set_to_none=True)
    result = ls.Engine(model, exec_cfg).step(group, grpo)
    got = grads_of(model)
    model.zero_grad(set_to_none=True)
    extra = {} if grpo.temperature == 1.0 else {"temperature": grpo.temperature}
    logps = [reference_logprobs(model, group.prompt, r, **extra) for r in group.responses]
    loss = reference_grpo_loss(logps, group, loss_type=grpo.loss_type, epsilon_low=grpo.epsilon_low,
                               epsilon_high=grpo.epsilon_high, beta=grpo.beta, scale_rewards=grpo.scale_rewards,
                               max_completion_length=grpo.max_completion_length)
    loss.backward()
    assert_loss_close(result.loss, float(loss.detach()), rel)
    assert_grads_close(got, grads_of(model), rel)
    return result


# ----------------------------------------------------------------------------
# more dense-attention families: MoE routers, longrope, per-layer windows and RoPE, sinks

NEW_FAMILIES = ("qwen3_moe", "mixtral", "phi3", "glm4_moe", "minimax_m2", "olmo3", "gemma3_text", "gpt_oss")
WINDOWED_FAMILIES = ("olmo3", "gemma3_text", "gpt_oss")
"""The families whose `layer_types` alternate sliding (window 5) and full attention."""

_WINDOW = 5
_EXPERTS = dict(num_experts_per_tok=2, moe_intermediate_size=16)
_LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0, 1.3, 1.7, 2.2],
                 long_factor=[1.5, 2.5, 4.0, 7.0])
_FAMILY = {
    "qwen3_moe": ("Qwen3Moe", dict(head_dim=8, num_experts=4, norm_topk_prob=False, mlp_only_layers=[0], **_EXPERTS)),
    "mixtral": ("Mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=16)),
    "phi3": ("Phi3", dict(max_position_embeddings=64, original_max_position_embeddings=24, rope_parameters=_LONGROPE,
                         pad_token_id=None, bos_token_id=None, eos_token_id=None)),
    "glm4_moe": ("Glm4Moe", dict(head_dim=8, num_hidden_layers=3, n_routed_experts=4, n_shared_experts=1,
                                 first_k_dense_replace=1, n_group=1, topk_group=1, use_qk_norm=True,
                                 routed_scaling_factor=1.5, **_EXPERTS)),
    "minimax_m2": ("MiniMaxM2", dict(head_dim=8, num_local_experts=4, num_experts_per_tok=2, intermediate_size=16,
                                     rotary_dim=4)),
    "olmo3": ("Olmo3", dict(num_hidden_layers=3, sliding_window=_WINDOW,
                            layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "gemma3_text": ("Gemma3Text", dict(
        head_dim=8, num_hidden_layers=3, sliding_window=_WINDOW, query_pre_attn_scalar=12,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                         "full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1e6)})),
    "gpt_oss": ("GptOss", dict(head_dim=8, num_local_experts=4, num_experts_per_tok=2, intermediate_size=16,
                               sliding_window=_WINDOW, layer_types=["sliding_attention", "full_attention"])),
}


def tiny_family(family: str, *, dtype=torch.float64, seed: int = 0, **overrides):
    """A stock HF causal LM of one of `NEW_FAMILIES` (tiny random config built here),
    SDPA attention (gpt_oss: eager, its only one with sinks) and eager experts (torch's
    grouped_mm takes no float64); 1-D parameters (norm weights, router biases, sinks)
    randomised, since HF starts many of them at constants."""
    prefix, extra = _FAMILY[family]
    config = getattr(transformers, f"{prefix}Config")(**{**_BASE, **extra, **overrides})
    config._attn_implementation = "eager" if family == "gpt_oss" else "sdpa"
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    model_cls = getattr(transformers, f"{prefix.removesuffix('Text')}ForCausalLM")
    model = model_cls(config).to(dtype).eval()
    return randomised_constants(model, router_bias=True)


def randomised_constants(model, *, router_bias: bool = False):
    """`model` with its 1-D parameters (norm weights, dt_bias, A_log, D, ...) moved off
    HF's constant initial values by 0.1 N(0, 1), and with `router_bias` the MoE routers'
    `e_score_correction_bias` buffers too. Returns the model."""
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if router_bias and name.endswith("e_score_correction_bias"):
                b.add_(0.1 * torch.randn_like(b))
    return model


class _Float64Internals(torch.overrides.TorchFunctionMode):
    """Every cast to float32 (`.float()`, `.to(torch.float32)`, `.type(...)`,
    `softmax(dtype=torch.float)`) becomes a cast to float64."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.float:
            return args[0].to(torch.float64)
        swap = lambda x: torch.float64 if x is torch.float32 else x  # noqa: E731
        return func(*(swap(a) for a in args), **{k: swap(v) for k, v in kwargs.items()})


@contextlib.contextmanager
def float64_internals():
    """Within the block, HF's float32 internals of a float64 model (RMSNorms, MoE
    routers, RoPE tables) compute in float64: same maths, so the engine (run in the block
    too) is compared with HF at float64 precision. Stock HF rounds each router's
    probabilities and each norm's output to float32, and exact mode sums a prompt
    token's gradient over branches before that rounding where the per-branch reference
    rounds each branch's share: ~1e-7 apart (measured in tests/models/test_families.py)."""
    with _Float64Internals():
        yield


def _has_gated_deltanet(model) -> bool:
    return any(type(m).__name__.endswith("GatedDeltaNet") for m in model.modules())


@contextlib.contextmanager
def float64_throughout(model):
    """Within the block, a float64 `model` computes in float64 everywhere: HF's float32
    internals (`float64_internals`: norms, MoE routers, RoPE tables, HF's own GDN / KDA /
    SSD kernels' casts) and, for the GDN hybrids, `float64_hybrid`'s norms and kernel. The
    context for any comparison held to `FLOAT64`: without it two code paths that batch the
    same float32 products differently (a divided capture's rows against a chunk, decode
    against a replay, a tree against the flat group) agree only to float32 precision, and
    by how much depends on the CPU's vector width (issue 35)."""
    hybrid = float64_hybrid(model) if _has_gated_deltanet(model) else contextlib.nullcontext()
    with float64_internals(), hybrid:
        yield model


# ----------------------------------------------------------------------------
# tolerances: each follows from what is compared (issue 35); torch.testing.assert_close's
# per-dtype defaults are the model (float64 rtol 1e-7, float32 rtol 1.3e-6)

FLOAT64 = 1e-9
"""Relative bound where both sides compute in float64 throughout (`float64_throughout`):
float64's eps is 2.2e-16, and the tiny models' losses and gradients sum at most ~1e4
products through a few layers whose condition is far below 1e4, so two orderings of the
same sums differ by < 1e-11; 1e-9 leaves two orders of margin and still catches any
wrong term (a missing token or gradient path moves a result by >= 1e-3)."""

FLOAT32_INTERNALS = 1e-5
"""Relative bound where HF's float32 internals stay in on purpose (the stock-model
tests): each norm or router output is rounded to float32 (eps 1.2e-7), and a gradient
crosses ~10 such roundings in these 2-4 layer models, each of which two code paths may
round differently (exact mode sums a prompt token's gradient over branches before the
rounding, the per-branch reference after): ~1e-6 at worst, measured 1e-7 to 3e-7;
1e-5 is 100 eps."""


# ----------------------------------------------------------------------------
# Mamba2 + attention hybrids: Nemotron-H, Bamba, Granite 4.0 (granitemoehybrid)

MAMBA_FAMILIES = ("nemotron_h", "bamba", "granitemoehybrid")
_MAMBA_LAYERS = ["mamba", "attention", "mamba", "mamba"]
_MAMBA = {
    # Nemotron-H: one mixer per block; an MLP and a MoE block in the pattern too. Its
    # time_step_limit is (time_step_min, inf): a clamp that really bites below 1e-3.
    "nemotron_h": ("NemotronH", dict(
        layers_block_type=["mamba", "moe", "attention", "mamba", "mlp", "mamba"], head_dim=8, ssm_state_size=6,
        mamba_num_heads=4, mamba_head_dim=5, n_groups=2, conv_kernel=4, chunk_size=8, n_routed_experts=4,
        n_shared_experts=1, moe_intermediate_size=16, moe_shared_expert_intermediate_size=16, num_experts_per_tok=2,
        n_group=1, topk_group=1, use_conv_bias=True, mamba_proj_bias=True, layer_norm_epsilon=1e-5)),
    "bamba": ("Bamba", dict(
        num_hidden_layers=4, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=2,
        mamba_d_state=6, mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=8, mamba_proj_bias=True)),
    # Granite 4.0: MoE + shared MLP per layer, muP multipliers, logits_scaling
    "granitemoehybrid": ("GraniteMoeHybrid", dict(
        num_hidden_layers=4, layer_types=_MAMBA_LAYERS, mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1,
        mamba_d_state=6, mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=8, num_local_experts=4,
        num_experts_per_tok=2, shared_intermediate_size=24, embedding_multiplier=3.0, logits_scaling=2.5,
        residual_multiplier=0.7, attention_multiplier=0.3)),
}


def tiny_mamba(family: str, *, dtype=torch.float64, seed: int = 0, **overrides):
    """A stock HF Mamba2 hybrid (3+ Mamba2 layers, one attention layer) from a tiny config;
    1-D parameters (norm weights, dt_bias, A_log, D) randomised (HF starts them at constants)."""
    prefix, extra = _MAMBA[family]
    config = getattr(transformers, f"{prefix}Config")(**{**_BASE, **extra, **overrides})
    config._attn_implementation = "sdpa"
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).to(dtype).eval()
    return randomised_constants(model)


def hf_cached_logprobs_positioned(model, prompt, response, temperature=1.0):
    """`hf_cached_logprobs` with the continuation's position ids passed explicitly:
    Bamba's model forward numbers a cached call's tokens from 0 when given none (its
    `generate` passes them), which would rotate the continuation's attention wrongly."""
    with torch.no_grad():
        cache = model(prompt[:-1][None], use_cache=True).past_key_values
    cache = _out_of_place_linear_cache(copy.deepcopy(cache))
    inputs = torch.cat([prompt[-1:], response[:-1]])
    positions = torch.arange(prompt.numel() - 1, prompt.numel() - 1 + inputs.numel())[None]
    logits = model(inputs[None], past_key_values=cache, use_cache=True, position_ids=positions).logits[0]
    return gather_logprobs(logits, response, temperature)


# prefix trees: groups whose responses share segments

TREE_LENGTHS = dict(A=5, B=3, C=4, D=2, E=3, F=1, H=2, a=1, b=1, c=1, L=11)
"""Segment name -> tokens; a response is a string of segment names."""


def tree_group(spec, *, prompt_len=13, seed=0):
    """A `Group` whose responses are the strings of segment names in `spec` (one random
    token run per name, shared wherever the name recurs), with random rewards (G = 1:
    an advantage as given)."""
    import longstraw as ls

    g = torch.Generator().manual_seed(seed)
    seg = {name: torch.randint(0, 97, (n,), generator=g) for name, n in TREE_LENGTHS.items()}
    prompt = torch.randint(0, 97, (prompt_len,), generator=g)
    responses = [torch.cat([seg[c] for c in s]) for s in spec]
    rewards = torch.rand(len(spec), generator=g, dtype=torch.float64)
    advantages = torch.tensor([0.7], dtype=torch.float64) if len(spec) == 1 else None  # G = 1's own is 0: a skip
    return ls.Group(prompt=prompt, responses=responses, rewards=rewards, advantages=advantages)


# ----------------------------------------------------------------------------
# Kimi Linear: KDA + NoPE MLA layers, MoE blocks

_KIMI = dict(vocab_size=97, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
             qk_nope_head_dim=12, v_head_dim=10, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
             linear_head_dim=8, linear_num_heads=4, linear_conv_kernel_dim=4,
             layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
             mlp_layer_types=["dense", "sparse", "sparse", "dense"], tie_word_embeddings=False, pad_token_id=0,
             bos_token_id=1, eos_token_id=2)


def tiny_kimi(*, dtype=torch.float64, seed: int = 0, **overrides):
    """A stock HF Kimi Linear model: 3 KDA layers, one MLA layer (second), MoE in the
    middle two; 1-D parameters (norm weights, dt_bias) and the router's correction bias
    randomised (HF starts them at constants)."""
    config = transformers.KimiLinearConfig(**{**_KIMI, **overrides})
    config._attn_implementation = "sdpa"
    config._experts_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.KimiLinearForCausalLM(config).to(dtype).eval()
    return randomised_constants(model, router_bias=True)


# ----------------------------------------------------------------------------
# Falcon-H1: attention and Mamba2 in parallel in every layer, muP multipliers

_FALCON = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, mamba_n_heads=4, mamba_d_head=8, mamba_d_ssm=32, mamba_d_state=6,
               mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=8, mamba_conv_bias=True, mamba_proj_bias=True,
               # every multiplier away from 1, so that a dropped one shows
               embedding_multiplier=2.0, lm_head_multiplier=0.6, key_multiplier=1.3, attention_in_multiplier=0.8,
               attention_out_multiplier=1.2, ssm_in_multiplier=0.9, ssm_out_multiplier=1.1,
               mlp_multipliers=[1.4, 0.7], ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.3],
               pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def tiny_falcon_h1(*, dtype=torch.float64, seed: int = 0, **overrides):
    """A stock HF Falcon-H1 model (3 parallel attention + Mamba2 layers); 1-D parameters
    randomised (HF starts them at constants)."""
    config = transformers.FalconH1Config(**{**_FALCON, **overrides})
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = transformers.FalconH1ForCausalLM(config).to(dtype).eval()
    return randomised_constants(model)
