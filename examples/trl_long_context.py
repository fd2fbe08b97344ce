"""Train with TRL on a long-context key-value retrieval task, through LongStraw.

The only change to a TRL training script is the trainer class:
`LongStrawGRPOTrainer` instead of `trl.GRPOTrainer`, plus `longstraw_config`.

The task (made in code from a seed, nothing is downloaded): each prompt is P tokens of
`key value` pairs followed by `QUERY key`; the reward is 1 when the completion's first
token is that key's value, 0.1 when it is some value token (shaping: it tells the policy
where answers live), else 0. The model is LongStraw's tiny Qwen3-shaped preset (random
weights, vocab 4096), the tokenizer maps the decimal ids "12 7 3" to [12, 7, 3].

Every step: one capture per prompt samples the G completions (`engine.generate`), the
rewards and TRL's advantages are computed as usual, and the update replays the G
branches one at a time against the same captured state (`engine.step`), so peak memory
is the model + one prompt state + one branch's graph, not G full sequences.

    .venv/bin/python examples/trl_long_context.py                        # P = 4096, 20 steps
    .venv/bin/python examples/trl_long_context.py --prompt-tokens 32768 --mode exact --steps 5
"""

from __future__ import annotations

import argparse
import random

import torch

VOCAB = 4096
EOS, QUERY = 1, 3
KEYS = range(100, 2100)
VALUES = range(2100, 2116)  # 16 possible answers


def kv_prompt(rng: random.Random, prompt_tokens: int) -> tuple[str, int]:
    """`k v k v ... QUERY k` with about prompt_tokens tokens; returns (text, value of k)."""
    pairs = (prompt_tokens - 2) // 2
    keys = rng.sample(KEYS, min(pairs, len(KEYS))) if pairs <= len(KEYS) else [rng.choice(KEYS) for _ in range(pairs)]
    table = {}
    ids = []
    for k in keys:
        v = rng.choice(VALUES)
        table[k] = v  # a repeated key keeps its last value
        ids += [k, v]
    asked = rng.choice(keys)
    ids += [QUERY, asked]
    return " ".join(map(str, ids)), table[asked]


def retrieval_reward(completion_ids, answer, **kwargs):
    """1 for the right value first, 0.1 for any value token first, else 0."""
    out = []
    for ids, want in zip(completion_ids, answer):
        first = ids[0] if ids else -1
        out.append(1.0 if first == want else 0.1 if first in VALUES else 0.0)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--prompts", type=int, default=32, help="prompts in the dataset")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--prompts-per-step", type=int, default=1, help="gradient accumulation over this many prompts")
    ap.add_argument("--max-completion-length", type=int, default=4)
    ap.add_argument("--mode", choices=("detached", "exact"), default="detached")
    ap.add_argument("--chunk-size", type=int, default=4096)
    ap.add_argument("--learning-rate", type=float, default=3e-4)
    ap.add_argument("--output-dir", default="/tmp/longstraw_trl_kv")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import datasets
    import trl

    import longstraw as ls
    from longstraw.integrations.trl import LongStrawGRPOTrainer, token_id_tokenizer
    from longstraw.tiny import tiny_model

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    rows = [kv_prompt(rng, args.prompt_tokens) for _ in range(args.prompts)]
    dataset = datasets.Dataset.from_dict({"prompt": [p for p, _ in rows], "answer": [a for _, a in rows]})
    model = tiny_model("qwen3", dtype=torch.float32, max_position_embeddings=max(131072, 2 * args.prompt_tokens))

    config = trl.GRPOConfig(
        output_dir=args.output_dir, max_steps=args.steps, learning_rate=args.learning_rate,
        per_device_train_batch_size=args.num_generations, gradient_accumulation_steps=args.prompts_per_step,
        num_generations=args.num_generations, max_completion_length=args.max_completion_length,
        temperature=1.0, beta=0.0, loss_type="dapo", logging_steps=1, save_strategy="steps", save_steps=10,
        use_cpu=not torch.cuda.is_available(), bf16=False, report_to=[], seed=args.seed)
    trainer = LongStrawGRPOTrainer(
        model=model, reward_funcs=retrieval_reward, args=config, train_dataset=dataset,
        processing_class=token_id_tokenizer(VOCAB, eos_token_id=EOS),
        longstraw_config=ls.ExecConfig(mode=args.mode, chunk_size=args.chunk_size))
    trainer.train()

    # on-policy GRPO's loss is about 0 by construction (advantages sum to 0 per group, ratio 1);
    # the gradient norm beside it is what trains ("no update": every reward of the step's groups equal)
    print(f"\n{'step':>4} {'reward':>7} {'loss':>10} {'grad norm':>9} {'state MiB':>9} {'capture s':>9} "
          f"{'generate s':>10} {'replay s':>8} {'peak MiB':>9}")
    for h in trainer.state.log_history:
        if "reward" not in h:
            continue
        skipped = h["longstraw/skipped_zero_advantage"] + h["longstraw/skipped_no_loss_tokens"]
        norm = "no update" if skipped == h["longstraw/groups"] else f"{h.get('grad_norm', float('nan')):.3g}"
        print(f"{h['step']:>4} {h['reward']:>7.3f} {h['loss']:>10.3g} {norm:>9} "
              f"{h['longstraw/state_bytes'] / 2**20:>9.1f} "
              f"{h['longstraw/time_capture_s']:>9.2f} {h['longstraw/time_generate_s']:>10.2f} "
              f"{h['longstraw/time_replay_s']:>8.2f} {h['longstraw/peak_memory_bytes'] / 2**20:>9.0f}")


if __name__ == "__main__":
    main()
