"""The one FSDP2 wrapping of a model that LongStraw runs: `shard_model`. The template
(`examples/torchrun_grpo.py`) and the TRL trainer (`integrations/trl_fsdp.py`) call it;
`longstraw train` does not shard.

What it does, and why each part:

* Each decoder layer `fully_shard`-ed with `reshard_after_forward=True`: a layer's
  weights are gathered in its pre-forward hook and freed again in its post-forward hook.
* The ...ForCausalLM itself wrapped too, as the FSDP2 root, managing no parameter of its
  own (the embeddings, final norm and lm_head stay replicated: LongStraw calls them
  directly, never the root's forward, so the root's hooks would never gather them). Without
  a root every layer is its own root, and FSDP2 never reshards a root after forward: all
  layers stayed gathered through capture, replay, `generate` and `score` (issue 43 item 2).
* The root's lazy initialization run here (`parallel.fsdp.initialize_root`), since the
  engine never runs the root's forward: it makes the layers non-roots of one shared state
  (one post-backward callback per backward; FSDP2's backward prefetch of the next layer).

So at most two layers are gathered at a time: one in every forward, the one in backward
and the one prefetched (what `plan/memory.py` counts). Where a backward enters a layer
through tensors it made rather than through its output (exact mode's reverse walk seeds
each layer's state rows), FSDP2's pre-backward hook on the output does not fire first;
`parallel.fsdp.gathered_when_read` gathers such a layer before its saved weights are read.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import fully_shard

from longstraw.models.base import unwrap_causal_lm
from longstraw.parallel.fsdp import initialize_root


def decoder_layers(model) -> list:
    """The decoder layers of a Hugging Face ...ForCausalLM (PEFT-wrapped too)."""
    backbone = unwrap_causal_lm(model).model
    if not hasattr(backbone, "layers") and hasattr(backbone, "language_model"):
        backbone = backbone.language_model
    return list(backbone.layers)


def shard_model(model: nn.Module, mesh, *, ignored_params: set | None = None) -> list:
    """FSDP2 over `mesh` (a DeviceMesh: 1-D, or 2-D (replicate, shard) for HSDP) for
    LongStraw: every decoder layer `fully_shard`-ed, resharded after each forward; the
    ...ForCausalLM wrapped as the root over no parameter of its own (the rest replicated),
    and initialized. `ignored_params`: parameters no FSDP2 unit may manage (expert
    parallelism's own experts). Every rank must call it, before the optimizer is made.
    Returns the sharded layers."""
    ignored = set(ignored_params or ())
    layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True,
                    ignored_params={p for p in layer.parameters() if p in ignored} or None)
    root = unwrap_causal_lm(model)
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    own = {p for p in root.parameters() if id(p) not in in_layers}
    fully_shard(root, mesh=mesh, ignored_params=own | ignored or None)
    initialize_root(root)
    return layers


__all__ = ["decoder_layers", "shard_model"]
