"""Exact mode's reverse walk (`engine/walk.py`) with layer-wise recompute
(`ExecConfig.recompute_layers`, `Engine.walk_recomputes_layers`): each walk chunk keeps
only its decoder layers' inputs and recomputes one layer at a time in backward.

Float64 on CPU: recompute on equals off (loss, every `.grad`) for the dense, Gated
DeltaNet hybrid and MLA/DSA + MoE families, with the state offloaded, and under context
parallelism at W = 2 with the walk divided (`tests/recompute_worker.run_walk`). The
recompute really runs in the walk (each layer's MLP runs twice per walk chunk with
autograd), and the choice is reported as the step metric `walk_recompute_layers`.

Exact mode's recurrent snapshots in host memory (`ExecConfig.offload_snapshots`) equal
them on the device, move the bytes the planner counts, and the walk holds at most two
snapshot gradients per layer.
"""

import pytest
import torch

import longstraw as ls
from longstraw.state.prompt import RecurrentState
from longstraw.tensors import nbytes
from tests.models.test_recompute import EXEC, GROUP, MODELS, assert_recompute_changes_nothing
from tests.reference import assert_grads_close, assert_loss_close, grads_of, random_group
from tests.ranks import spawn


@pytest.mark.parametrize("state_device", [None, "cpu"])
@pytest.mark.parametrize("name", list(MODELS))
def test_walk_recompute_equals_no_recompute(name, state_device):
    group = random_group(GROUP["vocab"], GROUP["prompt_len"], GROUP["response_lens"], seed=8)
    metrics = assert_recompute_changes_nothing(MODELS[name](), group,
                                               dict(EXEC, mode="exact", state_device=state_device))
    assert metrics["walk_recompute_layers"] == 1.0


def _mlp_runs_with_grad(model, monkeypatch) -> list:
    """Spy on every decoder layer's MLP: appends one entry per call with autograd on."""
    runs = []
    for layer in model.model.layers:
        own = layer.mlp.forward

        def spy(*args, own=own, **kwargs):
            if torch.is_grad_enabled():
                runs.append(None)
            return own(*args, **kwargs)
        monkeypatch.setattr(layer.mlp, "forward", spy)
    return runs


def test_each_layer_runs_again_in_the_walk(monkeypatch):
    """Exact mode, one replay piece per branch: with recompute every layer's MLP runs
    twice per replay piece and per walk chunk (forward, then its recompute in backward);
    without, once."""
    model = MODELS["qwen3"]()
    group = random_group(GROUP["vocab"], GROUP["prompt_len"], [6, 6], seed=6)
    runs = _mlp_runs_with_grad(model, monkeypatch)
    counts = {}
    for rc in (False, True):
        runs.clear()
        result = ls.Engine(model, ls.ExecConfig(recompute_layers=rc, mode="exact", **EXEC)).step(group)
        counts[rc] = len(runs)
        assert result.metrics["walk_recompute_layers"] == float(rc)
    layers, chunks, branches = len(model.model.layers), -(-(GROUP["prompt_len"] - 1) // EXEC["chunk_size"]), 2
    assert counts == {False: layers * (branches + chunks), True: 2 * layers * (branches + chunks)}


def test_the_walk_follows_the_rule_for_its_chunks():
    """recompute_layers=None: the walk recomputes when one of its chunks' (min(chunk_size,
    P - 1) tokens) graph would exceed RECOMPUTE_GRAPH_SHARE x what the step holds
    anyway, whatever replay's pieces do."""
    from longstraw.defaults import RECOMPUTE_GRAPH_SHARE
    from longstraw.shapes import graph_bytes_per_token

    model = MODELS["qwen3"]()
    engine = ls.Engine(model, ls.ExecConfig(mode="exact", chunk_size=4096))
    tokens = int(RECOMPUTE_GRAPH_SHARE * engine.held_bytes() // graph_bytes_per_token(model, len(model.model.layers)))
    assert 8 < tokens < 4096, tokens
    assert engine.walk_recomputes_layers(tokens + 1) and not engine.walk_recomputes_layers(tokens)
    assert engine.walk_recomputes_layers(1 << 20) and not engine.walk_recomputes_layers(tokens // 2)
    assert not ls.Engine(model, ls.ExecConfig(mode="exact", chunk_size=tokens)).walk_recomputes_layers(1 << 20)
    assert not ls.Engine(model, ls.ExecConfig(mode="exact", recompute_layers=False)).walk_recomputes_layers(1 << 20)


def test_walk_recompute_under_context_parallelism(tmp_path):
    from tests import recompute_worker
    spawn(recompute_worker.run_walk, args=(2, str(tmp_path / "init")), nprocs=2, join=True)


# ----------------------------------------------------------------------------
# exact mode's recurrent snapshots in host memory (`ExecConfig.offload_snapshots`)


def _step(model, group, **kw):
    model.zero_grad(set_to_none=True)
    engine = ls.Engine(model, ls.ExecConfig(mode="exact", **kw))
    return engine, engine.step(group), grads_of(model)


@pytest.mark.parametrize("state_device", [None, "cpu"])
def test_offloaded_snapshots_equal_on_device(state_device):
    """Float64, qwen3_5 (GDN hybrid): snapshots in host memory give the on-device step's
    loss and every .grad (the same sums: staging only copies), and the bytes moved equal
    the planner's figures."""
    from longstraw.plan import PlanConfig, estimate

    model = MODELS["qwen3_5"]()
    group = random_group(GROUP["vocab"], GROUP["prompt_len"], GROUP["response_lens"], seed=10)
    kw = dict(EXEC, state_device=state_device, recompute_layers=True)
    _, want, want_grads = _step(model, group, offload_snapshots=False, **kw)
    engine, got, got_grads = _step(model, group, offload_snapshots=True, **kw)
    assert_loss_close(got.loss, want.loss, 1e-15)
    assert_grads_close(got_grads, want_grads, 1e-15)
    assert "snapshot_h2d_bytes" not in want.metrics
    plan = estimate(model.config.to_dict(), PlanConfig(
        prompt_tokens=GROUP["prompt_len"], group=3, response_tokens=7, mode="exact", dtype="float64",
        chunk_size=EXEC["chunk_size"], attention_block_size=EXEC["attention_block_size"],
        offload_state=state_device == "cpu", offload_snapshots=True))["exact_snapshots"]
    assert got.metrics["snapshot_h2d_bytes"] == plan["h2d_bytes"] > 0
    assert got.metrics["snapshot_d2h_bytes"] == plan["d2h_bytes"] > 0
    state = engine.capture(group.prompt, exact=True)
    on_host = [layer for layer in state.layers if isinstance(layer, RecurrentState)]
    assert sum(nbytes(*layer.snapshots[p]) for layer in on_host for p in layer.on_host) == plan["host_bytes"]


def test_an_offloaded_state_offloads_its_snapshots_by_default():
    model = MODELS["qwen3_5"]()
    group = random_group(GROUP["vocab"], GROUP["prompt_len"], [3, 2], seed=12)
    _, result, _ = _step(model, group, state_device="cpu", **EXEC)
    assert result.metrics["snapshot_d2h_bytes"] > 0
    assert not ls.ExecConfig(mode="detached", state_device="cpu").offloads_snapshots()
    with pytest.raises(ls.ConfigError, match="offload_snapshots"):
        ls.ExecConfig(offload_snapshots="yes")


def test_the_walk_holds_two_snapshot_gradients_per_layer(monkeypatch):
    """The walk takes each snapshot's gradient when it seeds the chunk ending there: while a
    chunk's backward adds into its start's gradient, `grads` holds only that one (the
    seed at its end is held by the walk): two per layer at a time, not one per chunk."""
    seen = []
    add = RecurrentState.add_grad

    def spy(self, position, which, grad):
        add(self, position, which, grad)
        seen.append(len(self.grads))
    monkeypatch.setattr(RecurrentState, "add_grad", spy)
    model = MODELS["qwen3_5"]()
    group = random_group(GROUP["vocab"], 40, [3, 2], seed=13)  # 7 chunks of 6
    _step(model, group, **EXEC)
    assert seen and max(seen) == 1
