"""Integrations with training frameworks. Each submodule imports its optional
dependencies itself, so `import longstraw` never needs them.

* `longstraw.integrations.trl`: `LongStrawGRPOTrainer`, TRL's `GRPOTrainer` with
  LongStraw's rollouts and update (`pip install longstraw[trl]`).
"""
