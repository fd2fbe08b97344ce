"""Every PEFT type PEFT offers, on a tiny MLA model (DeepSeek-V3), against Hugging
Face: equal (loss and every gradient, float64), or refused with UnsupportedModelError
before any work (`longstraw/models/peft_layers.py`).

Two placements: on kv_b_proj, whose weight absorbed MLA multiplies by itself (the
adapter's own map is needed as a matrix), and on the MLA modules LongStraw calls as
modules (q_a_proj, q_b_proj, kv_a_proj_with_mqa, o_proj), where any adapter that maps
each token by itself works. Adapter weights are perturbed away from their (often
identity) initialisation, so an adapter that is ignored cannot pass.
"""

import pytest
import torch

import longstraw as ls
from longstraw.models.peft_layers import AFFINE_TUNERS, PER_TOKEN_TUNERS
from tests.reference import compare_step, float64_norms, hf_cached_logprobs, random_group, tiny_mla

peft = pytest.importorskip("peft")

# Every PeftType: config overrides for this tiny model (kv_lora_rank 16), or why it has no Linear layer to test.
LINEAR_TYPES = {
    "LORA": {}, "ADALORA": dict(total_step=10, init_r=4, target_r=2), "BEFT": {}, "BOFT": {}, "C3A": dict(block_size=8),
    "DEFT": {}, "DELORA": {}, "FOURIERFT": dict(n_frequency=64), "FROD": {}, "GLORA": {}, "GRALORA": dict(r=4, gralora_k=2),
    "HIRA": {}, "HRA": {}, "IA3": dict(feedforward_modules=[]), "LILY": {}, "LN_TUNING": {}, "LOHA": {}, "LOKR": {},
    "MISS": dict(r=4), "OFT": dict(r=4, oft_block_size=0), "OSF": {}, "PEANUT": {}, "PVERA": {}, "RANDLORA": {},
    "ROAD": dict(group_size=8), "SHIRA": dict(r=4), "SUPERTUNING": {}, "TINYLORA": {}, "UNILORA": {},
    "VBLORA": dict(vector_length=8, num_vectors=16), "VERA": {}, "WAVEFT": dict(n_frequency=64),
    "PSOFT": dict(r=4), "SHADOW": {}, "POLY": {},
}
VARIANTS = {"LORA+DORA": ("LORA", dict(use_dora=True)), "LORA+lora_bias": ("LORA", dict(lora_bias=True)),
            "LORA+trainable_tokens": ("LORA", dict(trainable_token_indices=[3, 5, 8])),
            "IA3-feedforward": ("IA3", None)}
NOT_LINEAR = {
    "PROMPT_TUNING": "prompt learning (test_prompt_learning_is_refused)", "P_TUNING": "prompt learning",
    "PREFIX_TUNING": "prompt learning", "MULTITASK_PROMPT_TUNING": "prompt learning", "CPT": "prompt learning",
    "CARTRIDGE": "a learned KV prefix (prompt learning)", "ADAPTION_PROMPT": "llama-only attention prompts",
    "TRAINABLE_TOKENS": "embedding rows, not a Linear", "XLORA": "needs trained LoRA adapters to load",
    "ADAMSS": "needs scikit-learn",
}
KV_B = ["kv_b_proj"]
CALLED = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"]


def test_every_peft_type_is_classified():
    """A PEFT release that adds a type makes this fail until it is tested here."""
    assert {t.value for t in peft.PeftType} == set(LINEAR_TYPES) | set(NOT_LINEAR)


def _wrapped(kind: str, targets):
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    name, kwargs = VARIANTS.get(kind, (kind, LINEAR_TYPES.get(kind)))
    if kind == "IA3-feedforward":
        kwargs = dict(feedforward_modules=targets)  # IA3 scales the input instead of the output
    config = PEFT_TYPE_TO_CONFIG_MAPPING[peft.PeftType(name)](target_modules=targets, **kwargs)
    model = peft.get_peft_model(tiny_mla("deepseek_v3", dtype=torch.float32), config).double()  # PSOFT inits in fp32
    torch.manual_seed(1)
    with torch.no_grad():  # away from the identity init: an ignored adapter must show
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
    return float64_norms(model).eval()


def _tuner(model, target):
    module = getattr(model.base_model.model.model.layers[0].self_attn, target)
    return type(module).__module__.split(".")[2]


KINDS = sorted(set(LINEAR_TYPES) | set(VARIANTS))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("targets", [KV_B, CALLED], ids=["kv_b_proj", "called_modules"])
def test_adapter_on_mla_equals_hf_or_is_refused(kind, targets):
    try:
        model = _wrapped(kind, targets)
        tuner = _tuner(model, targets[0])
    except ValueError as exc:  # PEFT itself refuses the adapter on this model (e.g. Poly wants task ids)
        pytest.skip(f"PEFT cannot build {kind} here: {exc}")
    group = random_group(97, 12, [4, 3], seed=4)
    supported = tuner in (AFFINE_TUNERS if targets == KV_B else PER_TOKEN_TUNERS)
    if not supported:
        with pytest.raises(ls.UnsupportedModelError, match=tuner):
            ls.Engine(model, ls.ExecConfig(chunk_size=5)).step(group)
        assert all(p.grad is None for p in model.parameters())
        return
    compare_step(model, group, ls.ExecConfig(chunk_size=5), hf_cached_logprobs, 1e-6)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_prompt_learning_is_refused_before_any_work():
    """Prompt tuning's virtual tokens are added by PeftModel.forward, which LongStraw
    never calls: it would silently drop them."""
    model = peft.get_peft_model(tiny_mla("deepseek_v3"), peft.PromptTuningConfig(
        task_type="CAUSAL_LM", num_virtual_tokens=3)).eval()
    with pytest.raises(ls.UnsupportedModelError, match="prompt learning"):
        ls.Engine(model)


def test_an_adapter_added_after_construction_is_refused_before_any_work():
    """An aLoRA adapter acts only from its invocation tokens on (its output depends on
    the position); added once the engine exists, the next step refuses it."""
    model = peft.get_peft_model(float64_norms(tiny_mla("deepseek_v3")), peft.LoraConfig(
        target_modules=["q_b_proj"], r=2)).eval()
    engine = ls.Engine(model, ls.ExecConfig(chunk_size=5))
    model.add_adapter("late", peft.LoraConfig(target_modules=["o_proj"], r=2, alora_invocation_tokens=[5]))
    model.base_model.set_adapter(["default", "late"])
    with pytest.raises(ls.UnsupportedModelError, match="ALora"):
        engine.step(random_group(97, 12, [4, 3], seed=4))
    assert all(p.grad is None for p in model.parameters())
