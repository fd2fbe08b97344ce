"""Expert parallelism, the models' side: which of a Hugging Face model's modules are MoE
experts, how they are cut to this rank's slice (`shard_experts`), and how an expert
call picks its combine from the run's phase. The collectives and the geometry:
`parallel/experts.py` (the design is there).

In transformers 5.x every MoE family's experts are one module (`@use_experts_implementation`:
`Qwen3MoeExperts`, `MixtralExperts`, `GlmMoeDsaExperts`, ...) holding 3-D parameters whose
first dimension is the expert (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) and a
forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) that skips the sentinel
index E. `shard_experts` keeps, in place, rank r's slice [lo, hi) of each such parameter
(same names, so state dicts and optimizers see `...mlp.experts.gate_up_proj`), sets the
module's `num_experts` to hi - lo, and gives the instance a forward that calls HF's own
(class) forward over the slice inside the combine. Routers, shared experts, attention
and dense MLPs are untouched and stay replicated.

Why expert parallelism rather than FSDP2 units of a few experts: HF's experts are one
parameter per projection, so expert-sized FSDP2 units would need HF's parameter split
(and its forward rewritten); gathered one unit at a time they would still move every
expert's bytes to every rank each forward and again in backward (the whole layer's
E * 3 H I weights per rank per pass, and a reduce-scatter of their gradients), whatever
the tokens. Expert parallelism never moves weights: each rank holds E / W experts for
good and moves activations instead, per MoE call [T, H] (replicated tokens: one
all-reduce) or 2 [n, H] (divided tokens). At GLM-5.2's sizes (H 6,144, I 2,048, E 256,
W 32) one layer's experts are 19.3 GB in bf16; a replay piece of 1,024 tokens receives
24 MB per MoE layer: see docs/distributed.md.

PEFT: LoRA on attention, routers' neighbours, shared experts and dense MLPs keeps
working (those modules are untouched). PEFT's `target_parameters` LoRA on the experts'
3-D parameters wraps the experts module (`base_layer`) and is refused here.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from longstraw.host import on_host
from longstraw.errors import ConfigError, UnsupportedModelError
from longstraw.parallel.collectives import all_gather
from longstraw.parallel.deal import Deal
from longstraw.parallel.experts import SHARD_ATTR, combine_divided, combine_replicated, expert_bounds

from .pieces import MLP_PIECE, piece_rows
from .routing import Divided, DividedChunk, active_call

__all__ = ["experts_modules", "shard_experts", "is_sharded"]

_MARK = "_longstraw_experts"  # on a sharded experts module: (lo, hi, experts, world)


def experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every MoE experts module of `model`: an int `num_experts` and
    direct parameters of 3 dimensions whose first is the expert."""
    out = []
    for name, module in model.named_modules():
        experts = getattr(module, _MARK, (None, None, None))[2] or getattr(module, "num_experts", None)
        own = list(module.parameters(recurse=False))
        if isinstance(experts, int) and any(p.dim() == 3 for p in own):
            out.append((name, module))
    return out


def is_sharded(model: nn.Module) -> bool:
    """Whether `model`'s experts are cut to this rank's slices (`shard_experts`)."""
    return any(hasattr(m, _MARK) for _, m in experts_modules(model))


def shard_experts(model: nn.Module, cp) -> int:
    """Keep only this rank's slice of every MoE layer's experts (rank r of W: experts
    [r E // W, (r+1) E // W)), in place; returns the number of experts modules cut.
    Idempotent for the same group; the model's other parameters are untouched.

    Raises:
        ConfigError: the model has no experts modules, or fewer experts than ranks.
        UnsupportedModelError: an experts module's layout is not HF's fused one, it is
            already FSDP2-sharded (DTensor), or PEFT wraps it (`target_parameters`).
    """
    found = experts_modules(model)
    if not found:
        raise ConfigError(f"ExecConfig(expert_parallel=True) but {type(model).__name__} has no MoE experts module "
                          "(an int num_experts and 3-D expert parameters, transformers 5.x's layout); use "
                          "expert_parallel=False")
    for name, module in found:
        _check(name, module, cp)
    for name, module in found:
        if hasattr(module, _MARK):
            continue
        experts = module.num_experts
        lo, hi = expert_bounds(experts, cp.world, cp.rank)
        for pname, p in list(module.named_parameters(recurse=False)):
            cut = nn.Parameter(p.detach()[lo:hi].clone(), requires_grad=p.requires_grad)  # (hi - lo, ..)
            setattr(cut, SHARD_ATTR, (lo, hi, experts, cp.world))
            setattr(module, pname, cut)
        module.num_experts = hi - lo
        # HF's own flag: its grouped_mm / batched_mm forwards then mask the sentinel rows (without
        # it grouped_mm leaves them uninitialised and batched_mm indexes past the local experts)
        module._is_expert_parallel = True
        setattr(module, _MARK, (lo, hi, experts, cp.world))
        module.forward = _sharded_forward(module, lo, hi, experts, cp)
    return len(found)


def _check(name: str, module: nn.Module, cp) -> None:
    mark = getattr(module, _MARK, None)
    if mark is not None:
        if mark[3] != cp.world or expert_bounds(mark[2], cp.world, cp.rank) != mark[:2]:
            raise ConfigError(f"{name} is already expert-parallel over {mark[3]} ranks as experts {mark[:2]}; this "
                              f"engine's group has {cp.world} (rank {cp.rank}): build the model again")
        return
    experts = module.num_experts
    if experts < cp.world:
        raise ConfigError(f"ExecConfig(expert_parallel=True): {name} has {experts} experts for {cp.world} ranks, so "
                          "some rank would hold none; use expert_parallel=False or fewer context-parallel ranks")
    if name.endswith("base_layer"):
        raise UnsupportedModelError(f"{name} is wrapped by PEFT (LoRA on the experts' 3-D parameters, "
                                    "target_parameters), which expert parallelism cannot slice; target the "
                                    "attention / shared-expert modules, or use expert_parallel=False")
    for pname, p in module.named_parameters(recurse=False):
        if isinstance(p, DTensor):
            raise UnsupportedModelError(f"{name}.{pname} is an FSDP2 shard: build the engine (or call "
                                        "longstraw.models.experts.shard_experts) before fully_shard, and pass the "
                                        "expert parameters to fully_shard(..., ignored_params=...)")
        if p.shape[0] != experts:
            raise UnsupportedModelError(f"{name}.{pname} has shape {tuple(p.shape)}, not [num_experts={experts}, ..]: "
                                        "not HF's fused experts layout; use expert_parallel=False")


def _sharded_forward(module: nn.Module, lo: int, hi: int, experts: int, cp):
    own = type(module).forward  # HF's (dispatching) forward, run over the local slices

    def forward(hidden_states, top_k_index, top_k_weights):  # (T, H), (T, k), (T, k)
        def local(h, index, weights):
            return own(module, h, index, weights)

        call = active_call()
        if call is not None and call.divides_tokens():  # each rank its own rows
            with on_host():  # host numbers (a shape), real in a rehearsal too: see `rows_of_every_rank`
                counts = rows_of_every_rank(hidden_states.shape[0], cp, call)
            return combine_divided(local, hidden_states, top_k_index, top_k_weights, lo, hi, experts, counts, cp)
        return combine_replicated(local, hidden_states, top_k_index, top_k_weights, lo, hi, cp)
    return forward


def rows_of_every_rank(n: int, cp, call) -> list[int]:
    """Every rank's rows of a divided call, in rank order: one all-gather of a host number.
    On a rehearsal's fake process group the all-gather hands back this rank's number W
    times, so there the deal's counts are taken instead (`dealt_rows`), the same numbers
    every rank's own count would give; the all-gather still runs (its bytes are a real
    run's)."""
    counts = [int(c) for c in torch.cat(all_gather(torch.tensor([float(n)], dtype=torch.float64), cp)).tolist()]
    if getattr(cp, "backend", None) == "fake":
        dealt = dealt_rows(call)
        if dealt is not None and dealt[cp.rank] == n:
            return dealt
    return counts


def dealt_rows(call) -> list[int] | None:
    """Every rank's rows of a divided call from the deal alone: a divided walk's chunk
    (`DividedChunk`: its positions each rank owns), a divided capture's MLP piece (the
    piece's rows of each rank's own positions, `base.MLP_PIECE`); None where not known."""
    d = call.divided
    if isinstance(d, DividedChunk):
        return Deal(world=d.world, block=d.block).counts(d.start, d.end)
    piece = MLP_PIECE.get()
    if isinstance(d, Divided) and piece is not None:
        return [piece_rows(d.deal.count(d.total, s), piece[1], piece[0]) for s in range(d.world)]
    return None
