"""Integrations with training frameworks. Each submodule imports its optional
dependencies itself, so `import longstraw` never needs them.

* `longstraw.integrations.trl`: `LongStrawGRPOTrainer`, TRL's `GRPOTrainer` with
  LongStraw's rollouts and update (`pip install longstraw[trl]`), TRL's tools included.
* `longstraw.integrations.chat`: `tool_chat_tokenizer`, a tokenizer whose chat template
  and response template TRL's tool loop can use, for models built in code.
"""
