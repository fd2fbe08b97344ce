"""The engine: `Engine` (validate, capture, score, step), branch replay and exact mode's
reverse walk (`engine.py`), rollouts from the captured state (`rollout.py`), the GRPO
loss (`grpo.py`), chunked log-probs (`logprobs.py`) and kept capture graphs
(`kept_graphs.py`)."""

from .engine import Engine

__all__ = ["Engine"]
