"""The reference training loop: it learns an easy task, resumes onto the same curve,
and its full-sequence baseline step has the exact-mode gradient."""

import contextlib
import json
import os
import warnings

import pytest
import torch

import longstraw as ls
from bench.learning.arms import LearningConfig, full_sequence_step
from longstraw.train import TrainConfig, build_model, engine_update, train

from .reference import float64_hybrid, float64_norms

# An easy task at a tiny P: one fact whose value is always the same token (num_values=1),
# from random weights (no warm start): the policy must find "that token, then EOS".
EASY = dict(prompt_tokens=16, num_facts=1, num_values=1, num_keys=2, num_filler=4, records=True,
            warm_steps=0, group_size=8, prompts_per_step=4, lr=1e-2, eval_prompts=4, chunk_size=8,
            progress=False, log_kl=False, threads=1)
# The resume test's setting: a real lookup (4 values) after a short warm start.
LOOKUP = dict(EASY, num_values=4, warm_steps=10, warm_min_prompt_tokens=16, warm_prompt_tokens=16, warm_batch=8,
              warm_lr=1e-2, lr=3e-3)


def _log(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_training_improves_reward(tmp_path):
    """Mean training reward of the last 5 of 15 steps beats the first 5 by a margin,
    averaged over 3 seeds (measured gains +0.75, +0.63, +0.38 for seeds 0-2, and +0.37,
    +0.34 for seeds 3-4; asserted: mean > +0.25)."""
    gains = []
    for seed in range(3):
        out = tmp_path / f"s{seed}"
        train(TrainConfig(**EASY, arm="exact", steps=15, eval_every=15, seed=seed, model_seed=seed,
                          out_dir=str(out)))
        rewards = [r["reward_mean"] for r in _log(out) if "reward_mean" in r]
        gains.append(sum(rewards[-5:]) / 5 - sum(rewards[:5]) / 5)
    assert sum(gains) / len(gains) > 0.25, gains


def test_resume_equals_uninterrupted(tmp_path):
    """float64: 2 steps + checkpoint + resume for 2 more == 4 steps straight, bit for bit."""
    base = dict(LOOKUP, dtype="float64", arm="exact", eval_every=2, checkpoint_every=2, log_kl=True)
    straight = tmp_path / "straight"
    train(TrainConfig(**base, steps=4, out_dir=str(straight)))
    split = tmp_path / "split"
    train(TrainConfig(**base, steps=2, out_dir=str(split)))
    train(TrainConfig(**base, steps=4, out_dir=str(split)))  # resumes from step 2
    a = torch.load(straight / "checkpoint.pt", weights_only=False)
    b = torch.load(split / "checkpoint.pt", weights_only=False)
    assert a["step"] == b["step"] == 4
    for name, value in a["model"].items():
        assert torch.equal(value, b["model"][name]), name
    la, lb = _log(straight), _log(split)
    assert len(la) == len(lb) == 5  # the warm-start evaluation + 4 steps, no duplicates

    def measured(k):  # wall-clock and memory readings differ between runs by nature
        return "time" in k or k in ("tokens_per_s", "peak_rss_bytes")

    for ra, rb in zip(la, lb):
        assert {k: v for k, v in ra.items() if not measured(k)} == {k: v for k, v in rb.items() if not measured(k)}


@pytest.mark.parametrize("model", ["dense", "hybrid"])
def test_full_sequence_step_matches_exact(model):
    """The baseline arm's gradient (HF forward + backward per branch) equals exact mode's,
    in float64 with HF's float32 internals (norms, the GDN kernel) run in float64 (the
    hybrid to 1e-6, as in tests/models/test_hybrid.py's exact-mode checks)."""
    cfg = LearningConfig(**dict(LOOKUP, model=model, dtype="float64", prompt_tokens=40))
    net = build_model(cfg)
    with contextlib.ExitStack() as stack:
        if model == "hybrid":
            stack.enter_context(float64_hybrid(net))
        else:
            float64_norms(net)
        _compare_full_and_exact(net, cfg, 1e-9 if model == "dense" else 1e-6)


def _compare_full_and_exact(net, cfg, tol):
    task = cfg.task()
    item = task.item("train", 0)
    g = torch.Generator().manual_seed(0)
    responses = [torch.randint(8, 20, (n,), generator=g) for n in (1, 2, 2, 3)]
    group = ls.Group(prompt=item.prompt, responses=responses, rewards=torch.tensor([1.0, 0.0, 0.5, 0.25]))
    grpo = ls.GRPOConfig(loss_type="grpo")
    full_sequence_step(net, group, grpo)
    want = {n: p.grad.clone() for n, p in net.named_parameters()}
    net.zero_grad(set_to_none=True)
    ls.Engine(net, ls.ExecConfig(mode="exact", chunk_size=16)).step(group, grpo)
    for n, p in net.named_parameters():
        err = (p.grad - want[n]).norm() / want[n].norm().clamp_min(1e-300)
        assert err < tol, (n, float(err))


def test_kl_on_fewer_prompts_leaves_training_unchanged(tmp_path):
    """kl_prompts=1 scores only the first prompt under the reference: the logged KL is
    estimated on fewer samples, and nothing the update sees changes (beta = 0)."""
    base = dict(LOOKUP, dtype="float64", arm="detached", steps=2, eval_every=2, log_kl=True, prompts_per_step=2)
    logs = {}
    for k in (0, 1):
        out = tmp_path / f"kl{k}"
        train(TrainConfig(**base, kl_prompts=k, out_dir=str(out)))
        logs[k] = _log(out)[1:]
    for full, sub in zip(logs[0], logs[1]):
        assert sub["kl_ref"] is not None
        assert full["reward_mean"] == sub["reward_mean"] and full["grad_norm"] == sub["grad_norm"]
    assert logs[0][-1]["kl_ref"] != logs[1][-1]["kl_ref"]  # after one update, fewer samples: another estimate
    with pytest.raises(ValueError, match="kl_prompts"):
        TrainConfig(**base, kl_prompts=-1)


def test_replicas_are_checked_every_n_steps(tmp_path, monkeypatch):
    """replica_check_every=2 over 5 steps: check_replicas after steps 2 and 4, with the
    engine's process group (None in one process, where it compares nothing)."""
    import longstraw.train as loop

    calls = []
    real = loop.check_replicas
    monkeypatch.setattr(loop, "check_replicas", lambda model, group: calls.append(group) or real(model, group))
    train(TrainConfig(**dict(EASY, group_size=2, prompts_per_step=1), arm="detached", steps=5, eval_every=5,
                      replica_check_every=2, out_dir=str(tmp_path / "run")))
    assert calls == [None, None]
    with pytest.raises(ValueError, match="replica_check_every"):
        TrainConfig(**EASY, replica_check_every=-1)


# ----------------------------------------------------------------------------
# hardening: state lifetime, safe checkpoint loads, the non-finite guard, atomic writes

TINY = dict(LOOKUP, prompts_per_step=1, group_size=4, log_kl=False)


def test_at_most_one_prompt_state_is_alive_at_each_capture(tmp_path, monkeypatch):
    """Weak references to every captured state: when the loop (rollouts, the update,
    evaluation) captures, no earlier state is still alive."""
    import weakref

    from longstraw.engine.engine import Engine

    states, alive_at_capture = [], []
    capture = Engine.capture

    def spy(self, *args, **kwargs):
        alive_at_capture.append(sum(r() is not None for r in states))
        state = capture(self, *args, **kwargs)
        states.append(weakref.ref(state))
        return state

    monkeypatch.setattr(Engine, "capture", spy)
    train(TrainConfig(**dict(TINY, arm="exact", steps=4, eval_every=2, eval_prompts=2, out_dir=str(tmp_path))))
    assert len(alive_at_capture) > 4 + 2  # the rollouts' captures and the evaluations'
    assert alive_at_capture == [0] * len(alive_at_capture), alive_at_capture


class _Payload:
    """An arbitrary object: unpickling it would run code (here: create a file)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_checkpoints_load_weights_only(tmp_path, monkeypatch):
    """The resume path loads with weights_only=True, and a checkpoint holding an arbitrary
    pickled object is refused with CheckpointError, without running its code."""
    base = dict(TINY, arm="detached", eval_every=100, out_dir=str(tmp_path))
    train(TrainConfig(**base, steps=1))
    loads = []
    load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(k.get("weights_only")) or load(*a, **k))
    train(TrainConfig(**base, steps=2))  # resumes from step 1
    assert loads == [True]
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["step"] == 2

    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    marker = tmp_path / "code_ran"
    torch.save({**ckpt, "extra": _Payload(str(marker))}, tmp_path / "checkpoint.pt")
    with pytest.raises(ls.errors.CheckpointError, match="weights_only=True"):
        train(TrainConfig(**base, steps=3))
    assert not marker.exists()


def _poison(monkeypatch, bad_calls, snapshots):
    """Make the gradient of the Engine.step calls numbered in `bad_calls` NaN; record the
    weights each call saw (the weights after the previous update)."""
    from longstraw.engine.engine import Engine

    step, calls = Engine.step, []

    def poisoned(self, *args, **kwargs):
        snapshots.append({n: p.detach().clone() for n, p in self.model.named_parameters()})
        result = step(self, *args, **kwargs)
        if len(calls) in bad_calls:
            p = next(self.model.parameters())
            p.grad = torch.full_like(p, float("nan"))
        calls.append(1)
        return result

    monkeypatch.setattr(Engine, "step", poisoned)


def test_a_nonfinite_gradient_skips_the_update(tmp_path, monkeypatch):
    snapshots = []
    _poison(monkeypatch, {2}, snapshots)  # step 3's gradient is NaN
    train(TrainConfig(**dict(TINY, arm="exact", steps=5, eval_every=100, checkpoint_every=1, out_dir=str(tmp_path))))
    log = [r for r in _log(tmp_path) if "nonfinite_grad" in r]
    assert [r["nonfinite_grad"] for r in log] == [0, 0, 1, 0, 0]
    assert [r["nonfinite_steps"] for r in log] == [0, 0, 1, 1, 1] and log[3]["nonfinite_in_row"] == 0
    assert log[2]["no_update"] == "no update (non-finite gradient, skipped)"
    for name, value in snapshots[2].items():  # the weights after step 3 are those after step 2
        assert torch.equal(snapshots[3][name], value), name
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert ckpt["step"] == 5 and all(bool(torch.isfinite(v).all()) for v in ckpt["model"].values())


def test_nonfinite_steps_in_a_row_stop_the_run_keeping_the_last_good_checkpoint(tmp_path, monkeypatch):
    snapshots = []
    _poison(monkeypatch, set(range(2, 100)), snapshots)  # every gradient from step 3 on is NaN
    with pytest.raises(ls.errors.NonFiniteError, match="2 steps in a row"):
        train(TrainConfig(**dict(TINY, arm="exact", steps=8, eval_every=100, checkpoint_every=1, max_nonfinite_steps=2,
                          out_dir=str(tmp_path))))
    log = [r for r in _log(tmp_path) if "nonfinite_grad" in r]
    assert [r["nonfinite_in_row"] for r in log] == [0, 0, 1, 2]  # it stopped at step 4
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert ckpt["step"] == 3  # step 4 (the second NaN in a row) wrote none
    for name, value in snapshots[2].items():  # the weights after step 2, the last good update
        assert torch.equal(ckpt["model"][name], value), name
    with pytest.raises(ValueError, match="max_nonfinite_steps"):
        TrainConfig(max_nonfinite_steps=0)


@pytest.mark.parametrize("target", ["config.json", "log.jsonl", "checkpoint.pt"])
def test_a_write_that_dies_leaves_the_previous_file(tmp_path, monkeypatch, target):
    """Every file the loop writes is written then renamed: a write that dies part way
    (here: fsync raises on the first write that changes `target`) leaves the file as it was."""
    import longstraw.train as train_mod

    base = dict(TINY, arm="detached", eval_every=1, eval_prompts=1, checkpoint_every=1, out_dir=str(tmp_path))
    train(TrainConfig(**base, steps=1))
    before = (tmp_path / target).read_bytes()
    fsync = os.fsync

    def dies(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if os.path.basename(path) in (target, target + ".tmp") and open(path, "rb").read() != before:
            raise OSError("disk gone")
        fsync(fd)

    monkeypatch.setattr(train_mod.os, "fsync", dies)
    with pytest.raises(OSError, match="disk gone"):
        train(TrainConfig(**base, steps=3))
    assert (tmp_path / target).read_bytes() == before


def test_a_restart_before_the_first_checkpoint_starts_the_log_afresh(tmp_path, monkeypatch):
    import longstraw.train as train_mod

    base = dict(TINY, arm="detached", steps=2, eval_every=100, checkpoint_every=2, out_dir=str(tmp_path))

    def killed(*args, **kwargs):
        raise KeyboardInterrupt("killed before the first checkpoint")

    with monkeypatch.context() as m:
        m.setattr(train_mod, "_save", killed)
        with pytest.raises(KeyboardInterrupt):
            train(TrainConfig(**base))
    assert [r["step"] for r in _log(tmp_path)] == [0, 1, 2] and not (tmp_path / "checkpoint.pt").exists()
    train(TrainConfig(**base))
    assert [r["step"] for r in _log(tmp_path)] == [0, 1, 2]


# ----------------------------------------------------------------------------
# the agent task: rollouts go through `environment=`, observations are masked

AGENT = dict(EASY, task_name="tool_lookup", prompt_tokens=24, num_facts=2, num_values=2, num_answers=2, num_keys=2,
             group_size=4, prompts_per_step=2, log_kl=True, warm_steps=40, warm_min_prompt_tokens=16,
             warm_prompt_tokens=16, warm_batch=8, warm_lr=1e-2)


def test_the_agent_task_trains_through_the_environment(tmp_path, monkeypatch):
    """Every rollout and evaluation episode calls the task's tool through
    engine.generate(environment=); the update's groups carry the rollout's loss masks
    (False exactly at the observation); the log counts the calls."""
    from longstraw.tasks import ToolLookup

    made, calls, groups = [], [], []
    real = ToolLookup.environment

    def environment(self, item):
        env = real(self, item)
        made.append(item)
        return lambda i, r: calls.append(r.tolist()) or env(i, r)

    def update(run, group, state, grpo, totals):
        groups.append(group)
        return engine_update(run, group, state, grpo, totals)

    monkeypatch.setattr(ToolLookup, "environment", environment)
    summary = train(TrainConfig(**AGENT, steps=2, eval_every=2, out_dir=str(tmp_path / "run")), update=update)
    assert len(made) == 2 * 2 + 2 * 4  # 2 steps x 2 prompts, and 2 evaluations (warm start, step 2) x 4 prompts
    log = _log(tmp_path / "run")
    assert sum(r["environment_calls"] for r in log[1:]) > 0 and summary["environment_calls"] == log[-1]["environment_calls"]
    assert len(calls) >= sum(r["environment_calls"] for r in log[1:])  # rollouts' calls (evaluation's besides)
    for group in groups:
        assert group.loss_masks is not None
        for r, m in zip(group.responses, group.loss_masks):
            obs = torch.zeros_like(m)
            if r.numel() > 2 and int(r[1]) == 1 and int(r[2]) == 4:  # id EOS RESULT answer ..: the tool answered
                obs[2:4] = True
            assert torch.equal(m, ~obs), (r.tolist(), m.tolist())
    assert any(not bool(m.all()) for g in groups for m in g.loss_masks)  # observations were masked


def test_a_bad_tool_output_stops_the_agent_task_before_the_update(tmp_path, monkeypatch):
    """A tool returning ids outside the vocabulary (or no tensor) raises EpisodeError from
    the rollout: no update runs and no .grad is written."""
    from longstraw.tasks import ToolLookup
    from longstraw.train import build_model as build

    for bad, match in ((torch.tensor([4, 10**6]), "outside the vocabulary"), ([4, 9], "LongTensor")):
        monkeypatch.setattr(ToolLookup, "environment", lambda self, item, bad=bad: (lambda i, r: bad))
        steps = []
        cfg = TrainConfig(**dict(AGENT, warm_steps=0, log_kl=False), steps=1, out_dir=str(tmp_path / "bad"),
                          resume=False)
        with pytest.raises(ls.EpisodeError, match=match):
            train(cfg, update=lambda *a: steps.append(1))
        assert steps == []
    model = build(cfg)
    assert all(p.grad is None for p in model.parameters())


def test_a_step_with_equal_rewards_says_no_update(tmp_path, monkeypatch, capsys):
    """Every response rewarded alike: the engine skips the group (zero advantage), and the
    log line and the progress bar say "no update (equal rewards)"; an updating step says nothing."""
    import itertools

    from longstraw.tasks import KVRecall

    import longstraw.train as loop
    from longstraw.skips import NoUpdateWarning

    captures = []  # the capture inside generate is the step's capture

    def rollouts(run, step, gen):
        out = loop._rollouts(run, step, gen)
        captures.append(sum(ro.metrics["time_capture_s"] for ro in out[0]))
        return out

    monkeypatch.setattr(KVRecall, "reward", lambda self, item, response: 1.0)
    with pytest.warns(NoUpdateWarning) as seen:  # every step skipped: one warning with what to change
        train(TrainConfig(**dict(TINY, arm="detached", steps=2, eval_every=100, progress=True, out_dir=str(tmp_path))),
              rollouts=rollouts)
    log = [r for r in _log(tmp_path) if r["step"] > 0]
    assert [r["no_update"] for r in log] == ["no update (equal rewards)"] * 2
    assert [r["skipped_zero_advantage"] for r in log] == [1.0, 1.0]
    assert "no update (equal rewards)" in capsys.readouterr().err
    assert len(seen) == 1 and "2 of 2 steps" in str(seen[0].message) and "--warm-steps" in str(seen[0].message)
    assert min(captures) > 0 and all(r["time_capture_s"] >= c for r, c in zip(log, captures, strict=True))
    turn = itertools.count()
    monkeypatch.setattr(KVRecall, "reward", lambda self, item, response: float(next(turn) % 2))  # 0, 1, 0, 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoUpdateWarning)  # every step updated: no warning
        train(TrainConfig(**dict(TINY, arm="detached", steps=2, eval_every=100, out_dir=str(tmp_path / "b"))))
    assert [r["no_update"] for r in _log(tmp_path / "b") if r["step"] > 0] == [None, None]
