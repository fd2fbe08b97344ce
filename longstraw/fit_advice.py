"""`DoesNotFitError`'s suggestions in the caller's terms.

`fit_config` finds what would fit in its own terms (`DoesNotFitError.smallest_budget` and
`.changes`: a smaller P, more context-parallel ranks, a pin dropped). Who says it decides
the words:

    "python"  ls.fit_config(...)                 memory_budget=..., prompt_tokens=..., ExecConfig fields
    "train"   longstraw train --memory-budget    --memory-budget ..., --prompt-tokens ..., torchrun
    "trl"     LongStrawGRPOTrainer(...)           longstraw_memory_budget=..., longstraw_prompt_tokens=...

    raise again(exc, "train")   # the same error, its changes said as `longstraw train` flags

Torch-free and dependency-free (the CLI imports it before torch).
"""

from __future__ import annotations

from longstraw.errors import DoesNotFitError

__all__ = ["TERMS", "say", "message", "again"]

TERMS = ("python", "train", "trl")

_BUDGET = {"python": "memory_budget={b}", "train": "--memory-budget {b}", "trl": "longstraw_memory_budget={b}"}
_PROMPT = {"python": "prompt_tokens={p}", "train": "--prompt-tokens {p}", "trl": "longstraw_prompt_tokens={p}"}
_FLAGS = {"chunk_size": "--chunk-size", "mode": "--arm"}
"""The `longstraw train` flag of each ExecConfig field it pins."""


def gib(n: int) -> str:
    """Bytes as GiB, four significant digits (0.03759 GiB, 131.9 GiB)."""
    return f"{n / 2**30:.4g} GiB"


def _ranks(change: dict, terms: str) -> str | None:
    w, fsdp2, ep = change["ranks"], change.get("fsdp2", False), change.get("expert_parallel", False)
    if terms == "train":  # the loop runs context parallelism under torchrun; it has no FSDP2 nor experts' sharding
        return None if fsdp2 or ep else f"{w} ranks: torchrun --nproc-per-node {w} -m longstraw.cli train ..."
    if terms == "trl":
        return (f"longstraw_context_parallel_size={w}" + (", longstraw_fsdp=True" if fsdp2 else "")
                + f" under torchrun --nproc-per-node {w}")
    return (f"context_parallel=True over {w} ranks (torchrun --nproc-per-node {w})"
            + (" with the decoder layers sharded by FSDP2 (fully_shard)" if fsdp2 else "")
            + (", expert_parallel=True" if ep else ""))


def _unpin(change: dict, terms: str) -> str | None:
    name, pinned, value = change["unpin"], change["pinned"], change["value"]
    if terms == "train":
        flag = _FLAGS.get(name)
        if flag is None:
            return None
        return ("--arm detached" if name == "mode" else
                f"no {flag} {pinned} (the fit then picks {flag} {value})")
    if terms == "trl":
        return f"longstraw_config without {name}={pinned!r} (the fit then picks {name}={value!r})"
    if name == "mode":
        return f"mode={value!r} instead of mode={pinned!r}"
    return f"no pinned {name}={pinned!r} (the search then fits with {name}={value!r})"


def say(change: dict, terms: str) -> str | None:
    """One change in `terms` (None: the caller cannot make it)."""
    if terms not in TERMS:
        raise ValueError(f"terms must be one of {TERMS}, got {terms!r}")
    if "memory_budget" in change:
        b = change["memory_budget"]
        return _BUDGET[terms].format(b=b) + f" ({gib(b)})"
    if "prompt_tokens" in change:
        return _PROMPT[terms].format(p=change["prompt_tokens"])
    if "ranks" in change:
        return _ranks(change, terms)
    if "unpin" in change:
        return _unpin(change, terms)
    return None


def message(what: str, smallest_budget: int | None, changes, terms: str) -> str:
    """The whole message: `what`, the smallest budget that fits, then the other changes."""
    out = what
    if smallest_budget is not None:
        out += f". The smallest budget that fits: {say({'memory_budget': smallest_budget}, terms)}"
    others = [text for text in (say(c, terms) for c in changes) if text]
    if others:
        out += "; or, at this budget: " + "; or ".join(others)
    return out


def again(exc: DoesNotFitError, terms: str, prefix: str = "", suffix: str = "") -> DoesNotFitError:
    """`exc` with its changes said in `terms` (`prefix` before it, `suffix` after)."""
    what = prefix + exc.what
    return DoesNotFitError(message(what, exc.smallest_budget, exc.changes, terms) + suffix, what=what,
                           smallest_budget=exc.smallest_budget, changes=exc.changes)
