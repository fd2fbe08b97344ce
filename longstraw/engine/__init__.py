"""The engine: `Engine` (the facade: validate, capture, score, step, generate) in
`engine.py`; the checks before any work (`validate.py`); capture (`capture.py`); branch
replay (`replay.py`) and exact mode's reverse walk (`walk.py`); rollouts from the
captured state (`rollout.py`); the GRPO loss, one `branch_loss` for every caller
(`grpo.py`); the step's metrics schema (`metrics.py`); chunked log-probs
(`logprobs.py`); kept capture graphs (`kept_graphs.py`); phase clock and progress bars
(`clock.py`)."""

from .engine import Engine

__all__ = ["Engine"]
