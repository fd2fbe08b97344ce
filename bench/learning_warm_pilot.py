"""Supervised pilot for a learning preset: does the model learn the lookup at short P?

    python bench/learning_warm_pilot.py LR STEPS [P] [MODEL]   # e.g. 3e-4 2000 64 hybrid

Trains the preset from scratch with Adam at LR on train-split prompts of P tokens (batch
32, cross-entropy on answer + EOS, the warm start's loss) and prints, every 100 steps, the
loss, the first answer token's accuracy over those 100 steps, and the wall time. It chose
the hybrid's learning rate (bench/results/learning/pilots/).
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.learning.arms import LearningConfig as TrainConfig  # noqa: E402  (the hybrid preset too)
from longstraw.train import build_model  # noqa: E402


def main() -> None:
    lr, steps = float(sys.argv[1]), int(sys.argv[2])
    prompt_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    model_name = sys.argv[4] if len(sys.argv) > 4 else "hybrid"
    torch.set_num_threads(1)
    cfg = TrainConfig(model=model_name, num_keys=8, warm_lr=lr)
    torch.manual_seed(0)
    model = build_model(cfg)
    task = cfg.task(prompt_tokens)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    n = cfg.num_queries + 1
    t0, hits = time.perf_counter(), []
    for s in range(steps):
        items = [task.item("train", s * 32 + b) for b in range(32)]
        ids = torch.stack([torch.cat([it.prompt, it.target[:-1]]) for it in items])  # (32, P + n - 1)
        targets = torch.stack([it.target for it in items])  # (32, n)
        logits = model(ids, logits_to_keep=n).logits  # (32, n, V)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        hits.append((logits[:, 0].argmax(-1) == targets[:, 0]).float().mean().item())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if s % 100 == 99:
            print(s + 1, round(loss.item(), 3), "acc", round(sum(hits[-100:]) / 100, 3),
                  round(time.perf_counter() - t0, 1), flush=True)


if __name__ == "__main__":
    main()
