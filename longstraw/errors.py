"""Exception types of LongStraw: one per kind of mistake.

Every error is raised before any expensive work starts (capture, replay), so a
caller that catches it finds the model and its `.grad` exactly as it left them.
All of them derive from `LongStrawError`; the input errors also derive from
`ValueError` so that generic handlers keep working.
"""


class LongStrawError(Exception):
    """Base class of every error LongStraw raises on purpose."""


class ConfigError(LongStrawError, ValueError):
    """An `ExecConfig` or `GRPOConfig` field has a value we cannot run with."""


class InvalidGroupError(LongStrawError, ValueError):
    """The `Group` (prompt, responses, rewards, log-probs) is malformed."""


class PositionLimitError(InvalidGroupError):
    """Prompt + response run past the model's `max_position_embeddings`."""


class UnsupportedModelError(LongStrawError, TypeError):
    """The model's architecture (or a feature of its config) is not supported."""


class PromptInputsError(InvalidGroupError):
    """A prompt's non-text inputs (`prompt_inputs`: pixel values, image grids, token types)
    are malformed or disagree with the prompt's image tokens."""


class UnsupportedInputError(LongStrawError, ValueError):
    """An input LongStraw does not run: images on a family without a supported vision tower,
    videos, or an image inside a response."""


class ModelStateError(LongStrawError, RuntimeError):
    """The model is in a state we refuse to run (e.g. train mode with dropout)."""


class StateMismatchError(LongStrawError, ValueError):
    """A captured prompt state was passed with a different prompt, engine or mode than it
    was captured for."""


class StaleStateError(StateMismatchError):
    """A captured prompt state is stale: the model's weights (or its active adapters)
    changed since it was captured. Capture again (e.g. call `generate` again)."""


class EpisodeError(LongStrawError, ValueError):
    """An agent episode's input is malformed: `max_turns`, a `prefix`, or an observation an
    environment returned (not a 1-D LongTensor of ids in the vocabulary)."""


class DistributedError(LongStrawError, RuntimeError):
    """A context-parallel collective failed (a rank died or hit an error, or the ranks disagree)."""


class CheckpointError(LongStrawError, ValueError):
    """A training checkpoint cannot be loaded: unreadable, or it holds objects other than
    tensors and plain containers (checkpoints load with `torch.load(weights_only=True)`)."""


class NonFiniteError(LongStrawError, RuntimeError):
    """Training produced non-finite numbers: the gradient norm stayed NaN/inf for too many
    steps in a row (each such update is skipped), or the weights are not finite (the
    checkpoint is then not overwritten)."""


class DoesNotFitError(LongStrawError, ValueError):
    """No configuration of the engine's options fits the memory budget (`fit_config`):
    the message names the binding term, the smallest budget that fits and the other
    changes that would fit, in the caller's terms (`fit_advice.py`).

    Attributes:
        what: what does not fit and its binding term (the message without the changes).
        smallest_budget: the least `memory_budget` in bytes at which the search fits with
            every pinned field kept (None: not computed).
        changes: the other changes that fit, one dict each in `fit_config`'s terms
            ({"prompt_tokens": 524288}, {"ranks": 4, "fsdp2": True, "expert_parallel":
            False}, {"unpin": "chunk_size", "pinned": 4096, "value": 1024}).
    """

    def __init__(self, message: str, *, what: str | None = None, smallest_budget: int | None = None,
                 changes=()):
        super().__init__(message)
        self.what, self.smallest_budget, self.changes = what or message, smallest_budget, list(changes)
