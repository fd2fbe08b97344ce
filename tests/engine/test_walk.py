"""Exact mode's reverse walk (`engine/walk.py`) with layer-wise recompute
(`ExecConfig.recompute_layers`, `Engine.walk_recomputes_layers`): each walk chunk keeps
only its decoder layers' inputs and recomputes one layer at a time in backward.

Float64 on CPU: recompute on equals off (loss, every `.grad`) for the dense, Gated
DeltaNet hybrid and MLA/DSA + MoE families, with the state offloaded, and under context
parallelism at W = 2 with the walk divided (`tests/recompute_worker.run_walk`). The
recompute really runs in the walk (each layer's MLP runs twice per walk chunk with
autograd), and the choice is reported as the step metric `walk_recompute_layers`.
"""

import pytest
import torch
import torch.multiprocessing as mp

import longstraw as ls
from tests.models.test_recompute import EXEC, GROUP, MODELS, assert_recompute_changes_nothing
from tests.reference import random_group


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
    """recompute_layers=None: the walk recomputes when its chunks (min(chunk_size, P - 1)
    tokens) are long enough, whatever replay's pieces do."""
    model = MODELS["qwen3"]()
    engine = ls.Engine(model, ls.ExecConfig(mode="exact", chunk_size=4096))
    assert engine.walk_recomputes_layers(1 << 20) and not engine.walk_recomputes_layers(100)
    assert not ls.Engine(model, ls.ExecConfig(mode="exact", chunk_size=512)).walk_recomputes_layers(1 << 20)
    assert not ls.Engine(model, ls.ExecConfig(mode="exact", recompute_layers=False)).walk_recomputes_layers(1 << 20)


def test_walk_recompute_under_context_parallelism(tmp_path):
    from tests import recompute_worker
    mp.spawn(recompute_worker.run_walk, args=(2, str(tmp_path / "init")), nprocs=2, join=True)
