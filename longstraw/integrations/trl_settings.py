"""What `LongStrawGRPOTrainer` cannot run: `unsupported_settings` lists the TRL settings it
refuses at construction, one message each naming the setting and the fix (the trainer
raises them together as one `ConfigError`). Re-exported by `integrations/trl.py`.
"""

from __future__ import annotations

import logging


from longstraw.config import ExecConfig

logger = logging.getLogger("longstraw.integrations.trl")

LOSS_TYPES = ("dapo", "grpo", "dr_grpo")
"""TRL loss types LongStraw computes (same names and meanings as `longstraw.GRPOConfig`)."""

# ----------------------------------------------------------------------------
# what cannot run here


def unsupported_settings(args, *, eval_dataset=None, processing_class=None, rollout_func=None,
                         longstraw_config: ExecConfig | None = None) -> list[str]:
    """The TRL settings LongStrawGRPOTrainer refuses, one message each (empty: all fine)."""
    bad = []

    def refuse(condition, message):
        if condition:
            bad.append(message)

    refuse(args.use_vllm, "use_vllm=True: rollouts come from engine.generate, which samples from the one prompt "
                          "capture the update reuses; set use_vllm=False")
    refuse(args.use_transformers_continuous_batching,
           "use_transformers_continuous_batching=True: rollouts come from engine.generate; set it to False")
    refuse(args.loss_type not in LOSS_TYPES,
           f"loss_type={args.loss_type!r}: supported are {LOSS_TYPES} (bnpo normalises per shuffled micro-batch, "
           "cispo/sapo/luspo/vespo use other objectives)")
    refuse(args.importance_sampling_level != "token",
           f"importance_sampling_level={args.importance_sampling_level!r}: only 'token' is supported")
    refuse(args.delta is not None, "delta (two-sided clipping of the ratio) is not supported; set delta=None")
    refuse(args.entropy_coef != 0 or args.use_adaptive_entropy,
           "the entropy bonus (entropy_coef / use_adaptive_entropy) is not supported; set entropy_coef=0")
    refuse(args.top_entropy_quantile < 1.0, "top_entropy_quantile < 1 is not supported; set it to 1.0")
    refuse(args.off_policy_mask_threshold is not None,
           "off_policy_mask_threshold is not supported; set it to None")
    refuse(args.mask_truncated_completions, "mask_truncated_completions=True is not supported; set it to False")
    refuse(args.beta != 0 and args.use_bias_correction_kl,
           "beta > 0 with use_bias_correction_kl=True (the KL weighted by the importance ratio) is not supported; "
           "set use_bias_correction_kl=False for the plain k3 KL")
    refuse(args.multi_objective_aggregation != "sum_then_normalize",
           f"multi_objective_aggregation={args.multi_objective_aggregation!r}: only 'sum_then_normalize' "
           "(its advantages are centred per group)")
    refuse(args.min_p is not None, "min_p sampling is not supported by engine.generate; set min_p=None")
    refuse(args.repetition_penalty != 1.0, "repetition_penalty is not supported by engine.generate; set it to 1.0")
    refuse(args.generation_kwargs, "generation_kwargs are not supported; engine.generate takes temperature, "
                                   "top_p, top_k and eos (from GRPOConfig and the tokenizer)")
    refuse(args.steps_per_generation != args.gradient_accumulation_steps,
           f"steps_per_generation={args.steps_per_generation} != gradient_accumulation_steps="
           f"{args.gradient_accumulation_steps}: one generation batch must be one optimizer step (whole prompt "
           "groups are stepped); leave steps_per_generation and generation_batch_size unset")
    refuse(args.fp16 or args.bf16, "fp16/bf16 autocast: LongStraw runs the model in its own dtype; load the model "
                                   "in bfloat16 instead and set bf16=False, fp16=False")
    refuse(args.cast_lm_head_to_fp32, "cast_lm_head_to_fp32=True is not supported; set it to False")
    refuse(args.use_liger_kernel, "use_liger_kernel=True is not supported; set it to False")
    refuse(args.deepspeed is not None or bool(args.fsdp),
           "DeepSpeed and the Trainer's FSDP (args.fsdp, an accelerate FSDP config) are not supported: LongStraw "
           "reduces the gradients itself; launch plain processes (torchrun / accelerate launch without a DeepSpeed "
           "or FSDP config) and pass longstraw_fsdp=True for FSDP2 over each context-parallel group "
           "(docs/distributed.md)")
    refuse(rollout_func is not None,
           "rollout_func is not supported: it generates outside LongStraw (typically on a vLLM server), so there is "
           "no prompt state to sample from and reuse, and its sampling log-probs feed an importance-sampling "
           "correction LongStraw does not apply; use tools= or environment_factory= for multi-turn rollouts")
    refuse(eval_dataset is not None or args.eval_strategy != "no",
           "evaluation (eval_dataset / eval_strategy) is not supported yet; set eval_strategy='no'")
    refuse(longstraw_config is not None and longstraw_config.context_parallel,
           "ExecConfig(context_parallel=True): the trainer sets up context parallelism itself; pass "
           "longstraw_context_parallel_size=C (ranks per prompt) and leave context_parallel=False")
    return bad


def turn_off_activation_checkpointing(args) -> None:
    """Set `args.gradient_checkpointing` (and its newer name `activation_checkpointing`) off:
    LongStraw replays one branch (or one chunk) at a time and never holds a full-sequence
    graph. TRL's GRPOConfig turns it on by default, so saying so is an info line, not a
    warning: nothing for the user to change."""
    if args.gradient_checkpointing or getattr(args, "activation_checkpointing", False):
        logger.info("LongStrawGRPOTrainer: turning gradient_checkpointing off; LongStraw replays one branch (or one "
                    "chunk) at a time and never holds a full-sequence graph")
        args.gradient_checkpointing = False
        if hasattr(args, "activation_checkpointing"):  # its newer name (transformers >= 5.x)
            args.activation_checkpointing = False
