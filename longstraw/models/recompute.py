"""Layer-wise recompute in replay and in exact mode's reverse walk: each decoder layer
of the model is checkpointed (`torch.utils.checkpoint`, `use_reentrant=False`), so a
replay piece (or a walk chunk: its T tokens, or under context parallelism this rank's
positions of it) keeps only every layer's input [1, T, d] and, in backward, recomputes
one layer's forward at a time: the live graph holds one layer's activations, not all of
them. The walk decides for its chunks by the same rule (`Engine.walk_recomputes_layers`).

This is LongStraw's own mechanism, applied to the model's own decoder layers by
replacing each layer's `forward` on the instance for one run (`forwards_replaced`); HF's
`gradient_checkpointing_enable` stays refused (`Adapter.check_runnable`).

What the recompute (run by autograd inside backward, after the run's context is gone)
must see and must not do:

- The same routing. The checkpointed body re-enters the family's `routing()` (GDN and
  MLA forwards replaced) and `routed(config, call)`, with a copy of the run's
  `AttentionCall` marked `recomputing`.
- No second side effect. A recompute writes no state: replay and a walk's recompute
  only read the prompt state (capture, which appends, runs under no_grad and is never
  checkpointed), and `AttentionCall.records_roots` is False while recomputing, so no
  chunk root is recorded twice. The state-gradient sinks are filled by backward
  functions of the *first* forward's graph (autograd backpropagates through that graph;
  the recomputed one only refills its saved tensors), so each adds once. GDN snapshot
  leaves made by the recompute are never backpropagated, so their hooks never fire.
- An offloaded state is staged again by the recompute's own read (`Stager.view`): by
  then the layer's rows sit in their slot (`Stager.restage` of the layer above
  prefetched them), so nothing more crosses.
- Under context parallelism the recompute re-runs the layer's collectives inside
  backward: every rank backpropagates the same graph in the same order, so they meet.
- Under FSDP2 (`parallel.sharding.shard_model`: layers resharded after forward) the
  recompute calls the layer's own forward, not its hooks, and exact mode's walk can reach
  it before FSDP2's pre-backward hook (the walk seeds each layer's own state rows): it
  gathers the layer first (`parallel.fsdp.gather_for_recompute`); the layer's post-backward
  hook reshards it as usual.
"""

from __future__ import annotations

import contextlib
import dataclasses

from torch.utils.checkpoint import checkpoint

from longstraw.defaults import RECOMPUTE_GRAPH_SHARE, recompute_pays  # the rule, shared with the planner
from longstraw.parallel.fsdp import gather_for_recompute

from .routing import AttentionCall, forwards_replaced, routed

__all__ = ["RECOMPUTE_GRAPH_SHARE", "recompute_pays", "recomputed_layers"]


@contextlib.contextmanager
def recomputed_layers(adapter, call: AttentionCall):
    """Within the block, each of `adapter`'s decoder layers runs checkpointed: its
    forward (hidden [1, T, d] and HF's keyword arguments -> its own outputs) keeps only
    its inputs, and is run again in backward under the same routing as `call`."""
    layers = list(adapter.backbone.layers)
    again = dataclasses.replace(call, recomputing=True)

    def checkpointed(layer):
        own = layer.forward

        def forward(*args, **kwargs):
            runs = []  # the first call is the forward itself (inside the run); any later one is a recompute

            def body(*args, **kwargs):
                runs.append(None)
                if len(runs) == 1:
                    return own(*args, **kwargs)
                gather_for_recompute(layer)  # FSDP2: backward may reach it before the layer's pre-backward hook
                with adapter.routing(), routed(adapter.config, again):
                    return own(*args, **kwargs)

            return checkpoint(body, *args, use_reentrant=False, **kwargs)
        return forward

    with forwards_replaced(layers, [checkpointed(layer) for layer in layers]):
        yield
