"""RoPE whose frequencies depend on the call's length ("dynamic", "longrope"), pinned.

Hugging Face's rotary module recomputes its frequencies from each call's largest
position (`dynamic_rope_update`): "longrope" takes its long factors once the sequence
is longer than original_max_position_embeddings, and "dynamic" (NTK) rescales its base
beyond max_position_embeddings. HF's one-pass forward over a group (prompt + response,
right-padded to the longest) thus uses the frequencies of prompt + longest response for
every position. LongStraw runs that sequence in many calls (capture chunks, branch
replays, the reverse walk, decode steps), so left alone each call would pick its own
frequencies and rotate the early chunks' keys differently.

Within `pinned_rope(backbone, length)`, every call of the model's rotary module runs
HF's own code as if the sequence were `length` long: one extra position, length - 1,
is appended to the call's position ids (so HF's update sees seq_len = length) and its
cos / sin column is dropped. The length is fixed per captured state
(`PromptState.rope_length`): prompt + longest response for `step` / `score`, prompt +
max_new_tokens for `generate`, whose state `step` and `score` then reuse with the
sampler's frequencies. Static types (default, linear, yarn, llama3, proportional) do
not depend on the length and run untouched.

HF's own `generate` re-picks the frequencies at every decode step and keeps the cached
keys rotated with the old ones, so it is not one consistent model once a generation
crosses the threshold; LongStraw's rollout instead equals HF's one-pass forward over
prompt + max_new_tokens positions (docs/rollouts.md).
"""

from __future__ import annotations

import contextlib

import torch

from ..errors import UnsupportedModelError


def length_dependent(rope_type) -> bool:
    """Whether a rotary module's `rope_type` (a str, or a dict per layer type) picks its
    frequencies from the call's length."""
    types = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
    return any(isinstance(t, str) and ("dynamic" in t or t == "longrope") for t in types)


def rotary_of(backbone):
    """The backbone's rotary module when its frequencies depend on the length, else None.
    Raises UnsupportedModelError for a length-dependent RoPE LongStraw cannot pin."""
    rope_type = getattr(getattr(backbone, "config", None), "rope_parameters", None) or {}
    rope_type = rope_type.get("rope_type", {k: v.get("rope_type") for k, v in rope_type.items()
                                            if isinstance(v, dict)})
    rotary = getattr(backbone, "rotary_emb", None)
    if rotary is not None and length_dependent(getattr(rotary, "rope_type", None)):
        return rotary
    if length_dependent(rope_type):
        raise UnsupportedModelError(
            f"rope_type {rope_type!r} picks its frequencies from each call's length, and "
            f"{type(backbone).__name__} has no single .rotary_emb module LongStraw can pin to the whole sequence's "
            "length; use a static rope_type (default, linear, yarn, llama3)")
    return None


@contextlib.contextmanager
def pinned_rope(backbone, length: int | None):
    """Within the block, the backbone's length-dependent rotary module (if any) computes
    cos / sin with the frequencies of a `length`-position sequence (see the module
    docstring). position_ids [..., T] -> cos, sin [..., T, D], as HF's forward."""
    rotary = rotary_of(backbone) if length is not None else None
    if rotary is None:
        yield
        return
    own = type(rotary).forward  # HF's decorated forward (its own frequency update included)

    def forward(x, position_ids, *args, **kwargs):
        last = torch.full_like(position_ids[..., :1], length - 1)  # HF's update reads max(position_ids) + 1
        cos, sin = own(rotary, x, torch.cat([position_ids, last], dim=-1), *args, **kwargs)
        return cos[..., :-1, :], sin[..., :-1, :]

    saved = rotary.__dict__.get("forward")
    rotary.forward = forward
    try:
        yield
    finally:
        if saved is None:
            del rotary.forward
        else:
            rotary.forward = saved
