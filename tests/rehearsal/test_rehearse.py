"""Rehearsals against real runs: the same tracker (`LiveBytes`) and the same measured step
(`measure_steps`) on a real tiny model and on its fake twin (`ls.rehearse`); the
per-phase peaks agree within 2%, and the FLOPs per phase are equal."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import longstraw as ls
from longstraw.host import HostSyncs, host_tensor, to_host
from longstraw.rehearsal.measure import measure_steps
from longstraw.rehearsal.run import rehearsal_group
from longstraw.rehearsal.tracker import LiveBytes
from longstraw.state.host_arena import host_buffer
from longstraw.tiny import tiny_model

P, G, R = 48, 2, 6


def _real(model, cfg, steps=1, shared_prefix=0, response_tokens=R):
    group = rehearsal_group(prompt_tokens=P, group=G, response_tokens=response_tokens,
                            vocab_size=model.config.vocab_size, shared_prefix=shared_prefix)
    tracker = LiveBytes("cpu")
    tracker.adopt(list(model.parameters()) + list(model.buffers()))
    return measure_steps(ls.Engine(model, cfg), group, ls.GRPOConfig(), steps=steps, tracker=tracker)


def _close(a: int, b: int, rel: float = 0.02) -> bool:
    return abs(a - b) <= rel * max(a, b)


def test_tracker_counts_real_and_fake_alike():
    """A matmul's forward and backward: the same live bytes, peak and phase peaks on
    real and on fake tensors (the weights adopted, a freed input taken off)."""
    results = []
    for fake in (False, True):
        ctx = FakeTensorMode() if fake else torch.enable_grad()
        with ctx:
            w = torch.empty(64, 32, requires_grad=True)
            tracker = LiveBytes("cpu")
            tracker.adopt([w])
            with tracker:
                with tracker.phase("forward"):
                    x = torch.empty(16, 64)
                    y = (x @ w).relu()
                    del x
                    loss = y.sum()
                with tracker.phase("backward"):
                    loss.backward()
                del y, loss
            results.append((tracker.live, tracker.peak, dict(tracker.phase_peaks)))
    assert results[0] == results[1]
    live, peak, phases = results[0]
    assert live == 2 * 64 * 32 * 4  # the weight and its gradient
    assert phases["forward"] == (64 * 32 + 16 * 64 + 2 * 16 * 32) * 4  # w, x, the matmul and its relu at once


def test_tracker_follows_storage_resizes_real_and_fake_alike():
    """FSDP2 frees a gathered layer by `storage.resize_(0)` and gathers it again by
    `resize_(n)`: the live bytes follow on real and on fake tensors alike (a fake
    tensor's storage is on `meta`: tested by its device, the resizes went unseen)."""
    results = []
    for fake in (False, True):
        with FakeTensorMode() if fake else torch.enable_grad():
            tracker = LiveBytes("cpu")
            with tracker:
                t = torch.empty(1000)
                seen = [tracker.live]
                t.untyped_storage().resize_(0)
                seen.append(tracker.live)
                t.untyped_storage().resize_(400)
                seen += [tracker.live, tracker.peak]
            results.append(seen)
    assert results[0] == results[1] == [4000, 0, 400, 4000]


def test_host_tensors_count_as_host_bytes_not_device_bytes():
    """`host_tensor` (the offload paths' one way to host memory): its result is host bytes
    (`host_peak`, `host_phase_peaks`), not device bytes, though host and device are both
    CPU here; real and fake alike, and freed host bytes leave `host_live`."""
    results = []
    for fake in (False, True):
        with FakeTensorMode() if fake else torch.enable_grad():
            tracker = LiveBytes("cpu")
            with tracker, tracker.phase("offload"):
                rows = torch.empty(64, 32)
                copy = host_tensor(lambda rows=rows: rows.to("cpu", copy=True))
                del rows
                arena = host_buffer(1000, pin=False)
                del copy, arena
            results.append((tracker.peak, tracker.host_peak, dict(tracker.host_phase_peaks), tracker.host_live))
    assert results[0] == results[1] == (64 * 32 * 4, 64 * 32 * 4 + 1000, {"offload": 64 * 32 * 4 + 1000}, 0)


def test_host_seam_counts_and_stands_in():
    """`to_host` of a fake tensor counts one sync and answers a stand-in; of a CPU
    tensor it answers the value and counts nothing."""
    HostSyncs.count = 0
    assert to_host(torch.tensor(2.5)) == 2.5 and to_host(torch.tensor([1, 2]), list) == [1, 2]
    assert HostSyncs.count == 0
    with FakeTensorMode():
        t = torch.ones(3)
        assert to_host(t, list) == [0, 0, 0] and to_host(t.sum()) == 0.0 and to_host(t, bytes) == bytes(12)
    assert HostSyncs.count == 3


def _slow(*values):
    return pytest.param(*values, marks=pytest.mark.slow)


TREE = dict(share_response_prefixes=True)  # with SHARED_PREFIX common first tokens: one shared segment, G leaves
SHARED_PREFIX, TREE_R = 4, 12
KEPT = dict(mode="exact", keep_graph_bytes=10**9)  # every capture chunk's graph kept: the walk recomputes none
MATRIX = [  # (family, ExecConfig fields, shared prefix tokens): the families in both modes, with and without
    ("qwen3", dict(mode="detached"), 0),  # pieces; kept graphs, offload and prefix trees
    _slow("qwen3", dict(mode="exact", branch_chunk_size=3), 0),
    _slow("qwen3_5", dict(mode="detached", branch_chunk_size=3), 0),
    _slow("qwen3_5", dict(mode="exact"), 0),
    _slow("glm_moe_dsa", dict(mode="exact"), 0),
    _slow("nemotron_h", dict(mode="detached"), 0),
    _slow("nemotron_h", dict(mode="exact", branch_chunk_size=3), 0),
    _slow("kimi_linear", dict(mode="detached", branch_chunk_size=3), 0),
    _slow("kimi_linear", dict(mode="exact"), 0),
    _slow("qwen3", KEPT, 0),
    _slow("qwen3_5", KEPT, 0),
    _slow("qwen3", dict(mode="detached", state_device="cpu"), 0),
    _slow("qwen3", dict(mode="exact", state_device="cpu"), 0),
    _slow("qwen3_5", dict(mode="exact", state_device="cpu"), 0),
    _slow("qwen3_5", dict(mode="exact", offload_snapshots=True), 0),
    _slow("qwen3", dict(mode="exact", **TREE), SHARED_PREFIX),
    _slow("qwen3_5", dict(mode="detached", branch_chunk_size=3, **TREE), SHARED_PREFIX),
]


@pytest.mark.parametrize("family,fields,shared", MATRIX)
def test_rehearsal_peaks_equal_the_real_step(family, fields, shared):
    """The rehearsal's peak and every phase's peak within 2% of the same step's real
    live-tensor peak (same tracker); FLOPs per phase equal. Host memory apart: an
    offloaded state's host arenas and offloaded snapshots (`longstraw.host.host_tensor`)
    are host bytes, on the CPU branches too, each phase's within 2% of the real step's;
    none without offload."""
    model = tiny_model(family)
    cfg = ls.ExecConfig(chunk_size=16, **fields)
    r = TREE_R if shared else R
    real = _real(model, cfg, shared_prefix=shared, response_tokens=r)[0]
    reh = ls.rehearse(model, cfg, prompt_tokens=P, group=G, response_tokens=r, device="cpu", shared_prefix=shared)
    assert set(reh.phases) == set(real.phases) == ({"capture", "replay", "walk"})
    assert _close(reh.peak_bytes_per_rank, real.peak_bytes), (reh.peak_bytes_per_rank, real.peak_bytes)
    for name, peak in real.phases.items():
        assert _close(reh.phases[name], peak), (name, reh.phases[name], peak)
    assert reh.flops == real.flops
    offload = fields.get("state_device") == "cpu" or fields.get("offload_snapshots", False)
    assert (reh.host_bytes > 0) == (real.host_peak_bytes > 0) == offload, (reh.host_bytes, real.host_peak_bytes)
    assert _close(reh.host_bytes, real.host_peak_bytes), (reh.host_bytes, real.host_peak_bytes)
    for name, peak in real.host_phases.items():
        assert _close(reh.host_phases[name], peak), (name, reh.host_phases[name], peak)


def test_host_syncs_do_not_grow_with_chunks():
    """Twice the capture chunks (and the walk's), the same host syncs per step."""
    config = tiny_model("qwen3").config
    counts = [ls.rehearse(config, ls.ExecConfig(chunk_size=c, mode="exact"), prompt_tokens=P, group=G,
                          response_tokens=R, device="cpu", dtype=torch.float32).host_syncs for c in (16, 8)]
    assert counts[0] == counts[1] > 0


@pytest.mark.parametrize("world_size", [1, 2])
def test_dsa_host_syncs_do_not_grow_with_chunks_or_pieces(world_size):
    """GLM-5.x with the DSA selection sparse (topk 8 of P = 48): twice the chunks, and a
    branch in pieces, the same host syncs per step. Before, sparse attention read its block
    counts once per call (per layer and chunk or piece)."""
    config = tiny_model("glm_moe_dsa", index_topk=8).config
    divided = dict(context_parallel=True, attention_block_size=8) if world_size > 1 else {}
    counts = [ls.rehearse(config, ls.ExecConfig(chunk_size=c, mode="exact", branch_chunk_size=b, **divided),
                          prompt_tokens=P, group=G, response_tokens=R, device="cpu", dtype=torch.float32,
                          world_size=world_size).host_syncs for c, b in ((16, None), (8, None), (8, 2))]
    assert counts[0] == counts[1] == counts[2] > 0, counts


@pytest.mark.slow
def test_second_rehearsed_step_peaks_as_the_first():
    """Two steps rehearsed (gradients set to None between): no leak, the second peak is the first's."""
    reh = ls.rehearse(tiny_model("qwen3").config, ls.ExecConfig(chunk_size=16, mode="exact"), prompt_tokens=P,
                      group=G, response_tokens=R, device="cpu", steps=2, dtype=torch.float32)
    first, second = (s.peak_bytes for s in reh.steps)
    assert _close(second, first, 0.005), (first, second)


def test_rehearse_refuses_what_it_cannot_rehearse():
    config = tiny_model("qwen3").config
    with pytest.raises(ls.ConfigError, match="world_size"):
        ls.rehearse(config, prompt_tokens=P, group=G, response_tokens=R, world_size=2, device="cpu")
    with pytest.raises(ls.ConfigError, match="prompt_tokens >= 2"):
        ls.rehearse(config, prompt_tokens=1, group=G, response_tokens=R, device="cpu")
    with pytest.raises(ls.ConfigError, match="group >= 2"):  # one response: no update, nothing rehearsed
        ls.rehearse(config, prompt_tokens=P, group=1, response_tokens=R, device="cpu")
    if not torch.backends.cuda.is_built():
        with pytest.raises(ls.ConfigError, match="CUDA build"):
            ls.rehearse(config, prompt_tokens=P, group=G, response_tokens=R, device="cuda")


def test_offloaded_snapshots_leave_the_device_under_context_parallelism():
    """A divided capture all-reduces a GDN layer's snapshots as one block; with
    `offload_snapshots` every snapshot but the latest moves to host, and the device must
    let go of them: the latest was a view of the block, which kept every snapshot on the
    device (found rehearsing Qwen3.6-27B exact on 8 ranks: +9 GiB a rank at P = 262,144).
    One rank of two on the fake group; replay's device peak falls by what went to host."""
    config = tiny_model("qwen3_5").config
    figures = {}
    for off in (False, True):
        cfg = ls.ExecConfig(chunk_size=8, mode="exact", context_parallel=True, attention_block_size=8,
                            offload_snapshots=off)
        r = ls.rehearse(config, cfg, prompt_tokens=P, group=G, response_tokens=R, device="cpu", dtype=torch.float32,
                        world_size=2, rank=0)
        figures[off] = (r.phases["replay"], r.host_bytes)
    (device_kept, _), (device_off, host) = figures[False], figures[True]
    assert host > 0 and device_off <= device_kept - 0.9 * host, (device_kept, device_off, host)


def test_progress_writes_a_line_as_each_phase_ends(capsys):
    """`progress=True`: one stderr line per rank, step and phase, in order (stdout untouched)."""
    ls.rehearse(tiny_model("qwen3").config, ls.ExecConfig(chunk_size=16, mode="exact"), prompt_tokens=P, group=G,
                response_tokens=R, device="cpu", dtype=torch.float32, progress=True)
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.startswith("rehearse: rank 0 of 1, step 1: ")]
    assert [line.split(": ")[2].split(" done")[0] for line in lines] == ["capture", "replay", "walk"], err
    assert all(" ops in the step so far)" in line for line in lines) and "rehearse:" not in out


def test_progress_writes_a_line_while_a_long_phase_runs(capsys, monkeypatch):
    """`progress=True`: a line every PROGRESS_EVERY_S seconds while a phase runs, naming it
    (patched to a few milliseconds here), with the running loop's position and time left at
    its pace; none without progress."""
    import longstraw.rehearsal.run as run

    monkeypatch.setattr(run, "PROGRESS_EVERY_S", 0.005)
    for progress in (True, False):
        ls.rehearse(tiny_model("qwen3").config, ls.ExecConfig(chunk_size=16, mode="exact"), prompt_tokens=P, group=G,
                    response_tokens=R, device="cpu", dtype=torch.float32, progress=progress)
        err = capsys.readouterr().err
        running = [line for line in err.splitlines() if " running at " in line]
        assert bool(running) == progress, err
        assert all(line.startswith("rehearse: rank 0 of 1: ") and " ops so far" in line for line in running)
        assert not progress or any(" left in it)" in line for line in running), err  # a loop's pace
        assert {line.split(": ")[2].split(" running")[0] for line in running} <= {"validation", "capture", "replay",
                                                                             "walk", "gradients"}


def test_a_loop_s_pace_gives_the_time_left():
    """`clock.loop_position` names the innermost named loop while it runs (nothing after),
    and `_pace` extrapolates its time left from the items done."""
    from longstraw.engine.clock import loop_position, progress
    from longstraw.rehearsal.run import _pace

    assert loop_position() is None
    seen = []
    for _ in progress(range(3), enabled=False, desc="reverse", total=3):
        for _ in progress(range(2), enabled=False, desc=None, total=2):  # unnamed: a branch's pieces
            seen.append(loop_position()[:3])
    assert seen == [("reverse", 0, 3)] * 2 + [("reverse", 1, 3)] * 2 + [("reverse", 2, 3)] * 2
    assert loop_position() is None
    assert _pace(None) == "" and _pace(("reverse", 0, 255, 10.0)) == ""
    assert _pace(("reverse", 37, 255, 370.0)) == "; reverse 37 of 255, ~36 min left in it"
    assert _pace(("capture", 9, 10, 9.0)) == "; capture 9 of 10, ~1 s left in it"
