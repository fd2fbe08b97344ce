"""State offload (`ExecConfig(state_device="cpu")`, `longstraw/state/offload.py`) against the
on-device engine, its naive twin, in float64 on CPU: the same staging code runs with
plain copies.

Every family (dense with and without sliding windows, hybrid GDN, MLA, GLM-5 and
DeepSeek-V3.2 with sparse DSA), detached and exact, chunk and branch-piece edges:
loss and every `.grad` equal the on-device engine's to 1e-12; rollouts, their
log-probs and `score` equal too; under context parallelism (W = 2, 3) each rank
offloads its shard with the same results. The attention ops read only the staging
slots (never the host rows), and at most two layers (the one running and the
prefetched one) are resident at a time. Bad settings raise `ConfigError` before work.
"""

import pytest
import torch

import longstraw as ls
from longstraw.state.offload import Stager, has_rows
from tests.reference import (
    assert_grads_close,
    assert_loss_close,
    float64_hybrid_norms,
    float64_norms,
    grads_of,
    random_group,
    tiny_hybrid,
    tiny_mla,
    tiny_model,
)
from tests.ranks import spawn

_HYBRID_TYPES = ["linear_attention", "full_attention", "full_attention", "linear_attention", "full_attention"]

# more layers with per-token rows than the stager's two slots, so staging really cycles
MODELS = {
    "qwen3": lambda: float64_norms(tiny_model("qwen3", num_hidden_layers=4)),
    # layers 0-2 full attention, 3-5 a sliding window of 5 (trimmed, on the device, when detached)
    "qwen2_window": lambda: float64_norms(tiny_model("qwen2", num_hidden_layers=6, use_sliding_window=True,
                                                     sliding_window=5, max_window_layers=3)),
    "qwen3_5": lambda: float64_hybrid_norms(tiny_hybrid("qwen3_5", num_hidden_layers=5, layer_types=_HYBRID_TYPES)),
    "glm_moe_dsa_sparse": lambda: tiny_mla("glm_moe_dsa", num_hidden_layers=4,
                                           indexer_types=["full", "shared", "full", "shared"]),
    "deepseek_v32_sparse": lambda: tiny_mla("deepseek_v32", num_hidden_layers=4),
    "deepseek_v3": lambda: tiny_mla("deepseek_v3", num_hidden_layers=3),
}
EXEC = dict(chunk_size=6, attention_block_size=4)


def assert_same_step(model, group, exec_kw: dict, rel: float = 1e-12):
    """Step on-device and offloaded; loss and every .grad agree to `rel`. Returns the
    offloaded engine."""
    model.zero_grad(set_to_none=True)
    want = ls.Engine(model, ls.ExecConfig(**exec_kw)).step(group)
    want_grads = grads_of(model)
    model.zero_grad(set_to_none=True)
    engine = ls.Engine(model, ls.ExecConfig(state_device="cpu", **exec_kw))
    got = engine.step(group)
    assert_loss_close(got.loss, want.loss, rel)
    assert_grads_close(grads_of(model), want_grads, rel)
    assert got.metrics["offload_h2d_bytes"] > 0 and got.metrics["state_bytes"] == want.metrics["state_bytes"]
    return engine


@pytest.mark.parametrize("mode", ["detached", "exact"])
@pytest.mark.parametrize("name", list(MODELS))
def test_offloaded_step_equals_on_device(name, mode):
    model = MODELS[name]()
    group = random_group(97, 21, [5, 1, 8], seed=11)
    assert_same_step(model, group, dict(mode=mode, **EXEC))


@pytest.mark.parametrize("chunk,pieces", [(1, None), (7, 3), (100, 2)])
def test_chunk_and_piece_edges(chunk, pieces):
    model = MODELS["qwen3"]()
    group = random_group(97, 17, [4, 1, 7], seed=12)
    assert_same_step(model, group, dict(mode="exact", chunk_size=chunk, branch_chunk_size=pieces,
                                        attention_block_size=3))


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5", "glm_moe_dsa_sparse", "deepseek_v32_sparse"])
def test_generate_and_score_equal_on_device(name):
    model = MODELS[name]()
    prompt = random_group(97, 23, [1], seed=3).prompt
    runs = []
    for extra in ({}, {"state_device": "cpu"}):
        engine = ls.Engine(model, ls.ExecConfig(**EXEC, **extra))
        rollout = engine.generate(prompt, num_samples=3, max_new_tokens=5, temperature=0.8,
                                  generator=torch.Generator().manual_seed(4))
        group = ls.Group(prompt=prompt, responses=rollout.responses, rewards=torch.tensor([1.0, 0.0, 0.5]))
        scores = engine.score(group, temperature=0.8, state=rollout.state)
        fresh = engine.score(group, temperature=0.8)
        model.zero_grad(set_to_none=True)
        loss = engine.step(group, state=rollout.state).loss
        runs.append((rollout, scores, fresh, loss, grads_of(model)))
    (a, sa, fa, la, ga), (b, sb, fb, lb, gb) = runs
    assert b.state.offload is not None and a.state.offload is None
    for i in range(3):
        assert torch.equal(a.responses[i], b.responses[i])
        for x, y in ((a.logprobs[i], b.logprobs[i]), (sa[i], sb[i]), (fa[i], fb[i])):
            assert (x - y).abs().max() <= 1e-12
    assert_loss_close(lb, la, 1e-12)
    assert_grads_close(gb, ga, 1e-12)


# ----------------------------------------------------------------------------
# what is resident where


def _storages(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("name,mode", [("qwen3", "exact"), ("glm_moe_dsa_sparse", "detached")])
def test_only_the_running_layer_and_the_prefetch_are_resident(monkeypatch, name, mode):
    """Every view the attention gets lives in a staging slot, never in host rows; the
    slots hold at most two layers (the running one and the prefetched next one), and
    they are sized for two layers, not for the state."""
    model = MODELS[name]()
    group = random_group(97, 21, [5, 1, 8], seed=11)
    seen = {"views": 0, "resident": 0}
    original = Stager.view

    def spy(self, idx, until):
        view = original(self, idx, until)
        slots = {_storages(b) for slot in self.buffers for b in slot.values()}
        host = {_storages(t) for layer in self.state.layers if has_rows(layer)
                for h in ([layer.latent] + ([layer.index] if layer.index is not None else [])
                          if hasattr(layer, "latent") else [layer])
                for t in ((h.keys,) if hasattr(h, "keys") and not hasattr(h, "k") else (h.k, h.v))}
        for h in ([view.latent] + ([view.index] if view.index is not None else [])
                  if hasattr(view, "latent") else [view]):
            tensors = (h.keys,) if hasattr(h, "keys") and not hasattr(h, "k") else (h.k, h.v)
            for t in tensors:
                assert _storages(t) in slots and _storages(t) not in host
        resident = {k[0] for k in self.holds if k is not None}
        assert idx in resident and len(resident) <= 2
        seen["views"] += 1
        seen["resident"] = max(seen["resident"], len(resident))
        return view

    monkeypatch.setattr(Stager, "view", spy)
    engine = ls.Engine(model, ls.ExecConfig(mode=mode, state_device="cpu", **EXEC))
    result = engine.step(group)
    assert seen["views"] > 0 and seen["resident"] == 2
    state = engine.capture(group.prompt, exact=mode == "exact")
    if mode == "exact":
        state.enable_grad_buffers()
    layer_bytes = [state.layers[i].nbytes() + state.layers[i].grad_nbytes() for i in state.offload.order]
    assert len(layer_bytes) >= 3  # more layers than slots
    assert max(layer_bytes) < result.metrics["offload_slot_bytes"] <= 2 * max(layer_bytes)
    assert result.metrics["offload_slot_bytes"] < sum(layer_bytes)
    for i in state.offload.order:  # host rows: CPU, pinned when CUDA is there
        layer = state.layers[i]
        k = layer.latent.k if hasattr(layer, "latent") else layer.k
        assert k.device.type == "cpu" and k.is_pinned() == torch.cuda.is_available()


def test_attention_reads_the_slots_not_the_host(monkeypatch):
    """The dense attention op's prefixes are slot tensors (an offload that handed the
    host rows to the op would still compute the right numbers on CPU)."""
    from longstraw.models import attention as attention_hook

    model = MODELS["qwen3"]()
    group = random_group(97, 21, [5, 3], seed=11)
    engine = ls.Engine(model, ls.ExecConfig(mode="exact", state_device="cpu", **EXEC))
    state = engine.capture(group.prompt, exact=True)
    host = {_storages(state.layers[i].k) for i in state.offload.order}
    calls = {"n": 0}
    original = attention_hook.prefix_causal_attention

    def spy(*args, prefixes, **kwargs):
        for seg in prefixes:
            if seg.k.shape[1]:
                assert _storages(seg.k) not in host
                calls["n"] += 1
        return original(*args, prefixes=prefixes, **kwargs)

    monkeypatch.setattr(attention_hook, "prefix_causal_attention", spy)
    engine.step(group, state=state)
    assert calls["n"] > 0


def test_trimmed_window_and_gdn_state_stay_on_the_device():
    """Constant-size state is not offloaded: a detached sliding-window layer's last W - 1
    rows and GDN snapshots are not staged."""
    for name, mode in (("qwen2_window", "detached"), ("qwen3_5", "exact")):
        model = MODELS[name]()
        engine = ls.Engine(model, ls.ExecConfig(mode=mode, state_device="cpu", **EXEC))
        state = engine.capture(random_group(97, 21, [1]).prompt, exact=mode == "exact")
        staged = set(state.offload.order)
        kinds = {type(layer).__name__ for i, layer in enumerate(state.layers) if i not in staged}
        assert kinds == ({"AttentionKV"} if name == "qwen2_window" else {"RecurrentState"}), kinds
        assert all(state.layers[i].window is None for i in staged) or name != "qwen2_window"


# ----------------------------------------------------------------------------
# context parallelism


@pytest.mark.parametrize("world,cases", [(2, ["planner", "qwen3", "qwen3_5", "glm_moe_dsa_sparse"]),
                                         (3, ["planner", "deepseek_v32_sparse"])])
def test_context_parallel_ranks_offload_their_shards(tmp_path, world, cases):
    from tests import offload_worker

    spawn(offload_worker.run, args=(world, str(tmp_path / "init"), cases), nprocs=world, join=True)


# ----------------------------------------------------------------------------
# bad settings


@pytest.mark.parametrize("value", ["tpu-9", "", 3, "cuda:x"])
def test_unknown_state_device_is_refused(value):
    with pytest.raises(ls.ConfigError, match="state_device"):
        ls.ExecConfig(state_device=value)


def test_state_device_on_another_accelerator_is_refused_before_any_work():
    model = tiny_model("qwen3")
    if torch.cuda.is_available():
        pytest.skip("the model is on CPU here only without CUDA")
    with pytest.raises(ls.ConfigError, match="state_device='cuda'.*model is on cpu"):
        ls.Engine(model, ls.ExecConfig(state_device="cuda"))
    ls.Engine(model, ls.ExecConfig(state_device="cpu"))  # offload from CPU to CPU: the staging path


def test_kept_graphs_with_offload_are_refused():
    with pytest.raises(ls.ConfigError, match="keep_graph_bytes"):
        ls.ExecConfig(mode="exact", keep_graph_bytes=1 << 20, state_device="cpu")


# ----------------------------------------------------------------------------
# the planner counts what the engine moves


@pytest.mark.parametrize("name,mode,pieces", [("qwen3", "detached", None), ("qwen3", "exact", 3),
                                              ("qwen3_5", "exact", None), ("qwen2_window", "exact", None),
                                              ("qwen2_window", "detached", 4), ("deepseek_v32_sparse", "exact", None)])
def test_planner_offload_figures_equal_the_engines(name, mode, pieces):
    """Host bytes, device slot bytes and host <-> device bytes of one step: the planner's
    `--offload-state` figures equal what the engine's stager allocated and counted."""
    from longstraw.plan import PlanConfig, estimate

    model = MODELS[name]()
    group = random_group(97, 21, [7, 7], seed=11)
    kw = dict(mode=mode, chunk_size=6, attention_block_size=4, branch_chunk_size=pieces)
    engine = ls.Engine(model, ls.ExecConfig(state_device="cpu", **kw))
    metrics = engine.step(group).metrics
    plan = estimate(model.config.to_dict(), PlanConfig(
        prompt_tokens=21, group=2, response_tokens=7, mode=mode, chunk_size=6, attention_block_size=4,
        branch_chunk_size=pieces, dtype="float64", offload_state=True))
    state = engine.capture(group.prompt, exact=mode == "exact")
    if mode == "exact":
        state.enable_grad_buffers()
    host = sum(state.layers[i].nbytes() + state.layers[i].grad_nbytes() for i in state.offload.order)
    assert plan["offload_host_bytes_per_rank"] == host  # the P - 1 positions the state holds
    o = plan["offload"]
    assert metrics["offload_h2d_bytes"] == sum(o["h2d_bytes"].values())
    assert metrics["offload_d2h_bytes"] == sum(o["d2h_bytes"].values())
    assert metrics["offload_slot_bytes"] == o["slot_bytes"]


def test_a_dropped_state_frees_its_slots_without_the_garbage_collector():
    """The stager does not keep its state alive (no reference cycle): dropping the state
    frees the host rows and the device slots at once."""
    import gc
    import weakref

    model = MODELS["qwen3"]()
    engine = ls.Engine(model, ls.ExecConfig(state_device="cpu", **EXEC))
    state = engine.capture(random_group(97, 21, [1]).prompt)
    gc.disable()
    try:
        slot = weakref.ref(next(iter(state.offload.buffers[0].values())))
        host = weakref.ref(state.layers[0].k)
        del state
        assert slot() is None and host() is None
    finally:
        gc.enable()


# ----------------------------------------------------------------------------
# host syncs


def test_decoding_never_blocks_the_host(monkeypatch):
    """`settle` blocks the host (the side stream's one sync path) only after copies to
    host were queued (capture's write-back, a backward's gradient sinks), never after a
    read-only pass: a rollout's host syncs do not grow with the tokens decoded."""
    calls = []
    sync = Stager._sync_host
    monkeypatch.setattr(Stager, "_sync_host", lambda self: (calls.append(1), sync(self))[1])
    engine = ls.Engine(MODELS["qwen3"](), ls.ExecConfig(state_device="cpu", **EXEC))
    prompt = random_group(97, 21, [1], seed=3).prompt
    counts = []
    for tokens in (1, 7):
        calls.clear()
        rollout = engine.generate(prompt, num_samples=2, max_new_tokens=tokens,
                                  generator=torch.Generator().manual_seed(1))
        assert all(r.numel() == tokens for r in rollout.responses)
        counts.append(len(calls))
    assert counts[0] == counts[1] > 0, counts  # capture's chunks wrote rows back; decoding wrote nothing
