"""A PEFT LoRA-wrapped model: the adapter calls the model's own (wrapped) modules."""

import pytest
import torch

import longstraw as ls
from tests.reference import (
    assert_grads_close,
    assert_loss_close,
    grads_of,
    hf_cached_logprobs,
    random_group,
    reference_grpo_loss,
    tiny_model,
)

peft = pytest.importorskip("peft")


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_lora_wrapped_model_matches_hf_and_only_lora_gets_grads(family):
    torch.manual_seed(0)
    base = tiny_model(family)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"],
                             init_lora_weights=False)
    model = peft.get_peft_model(base, config)
    model.eval()
    group = random_group(97, 15, [4, 6], seed=7)

    result = ls.Engine(model, ls.ExecConfig(chunk_size=4, attention_block_size=3)).step(group, ls.GRPOConfig())
    got = grads_of(model)
    lora = {n for n, p in model.named_parameters() if p.requires_grad}
    assert lora and all("lora_" in n for n in lora)
    for name, g in got.items():
        assert (g is not None) == (name in lora), name
    assert all(got[n].abs().sum() > 0 for n in lora)

    model.zero_grad(set_to_none=True)
    logps = [hf_cached_logprobs(model, group.prompt, r) for r in group.responses]
    loss = reference_grpo_loss(logps, group)
    loss.backward()
    assert_loss_close(result.loss, float(loss.detach()))
    assert_grads_close(got, grads_of(model), 1e-9)
