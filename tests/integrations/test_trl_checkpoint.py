"""`LongStrawGRPOTrainer` checkpoints through TRL's save and resume (`trl_checkpoint.py`):
float64, CPU, gloo, AdamW with weight decay and a linear LR decay over 3 steps
(`trl_worker.CHECKPOINTED`), a checkpoint after every optimizer step.

The reference is one uninterrupted process over 3 steps (`one_process`). Against it, to
1e-9 on every parameter and the logged loss:
- a fresh trainer resumed from its `checkpoint-1` to step 2 (`save_strategy="steps"`,
  `train(resume_from_checkpoint=...)`);
- W = 2 (C = 2 by default; C = 1 under `-m slow`), interrupted after step 1 and resumed
  at W = 2 to step 2: the same curve (W processes give one process's update, so this
  run's curve is the single process's);
- W = 2's step-2 checkpoint loaded at W = 1: the parameters and the optimizer state are
  bitwise the saved ones, and it trains on to the uninterrupted run's step 3.

The trainer's weights are replicated here (plain data and context parallelism); sharded
state is what DCP is for: the same W = 2 processes also write a checkpoint of FSDP2
shards through the module, which one process loads bitwise (`test_fsdp2_...`).
"""

import pytest
import torch
from tests.distributed_worker import spawn_each
from tests.reference import assert_loss_close

pytest.importorskip("trl")
pytest.importorskip("datasets")
from longstraw.errors import CheckpointError  # noqa: E402
from longstraw.integrations.trl_checkpoint import load_model, load_optimizer, read_meta  # noqa: E402
from tests.integrations import trl_worker as worker  # noqa: E402
from tests.integrations.test_trl_distributed import _free_port  # noqa: E402

CASE = "detached"


def _float64(fn):
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return fn()
    finally:
        torch.set_default_dtype(saved)


ONE_PROMPT = dict(data_groups=1, prompts_per_group=1)  # the global batch: one prompt group per step


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The uninterrupted 3-step run (a checkpoint after every step), and a fresh trainer
    resumed from its `checkpoint-1`, stopped after step 2."""
    root = tmp_path_factory.mktemp("one")
    whole = _float64(lambda: worker.record_run(CASE, str(root), steps=3, settings=worker.CHECKPOINTED, **ONE_PROMPT))
    resumed = _float64(lambda: worker.record_run(CASE, str(root / "resumed"), steps=3, settings=worker.CHECKPOINTED,
                                                 resume=str(root / "run" / "checkpoint-1"), stop_after=2,
                                                 **ONE_PROMPT))
    return dict(whole=whole, resumed=resumed, root=root)


def _close(got: dict, want: dict, rel: float = 1e-9) -> None:
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert (got[name] - w).abs().max() <= rel * w.abs().max() + 1e-12, name


def _loss_at(record: dict, step: int) -> float:
    return next(h["loss"] for h in record["logs"] if h["step"] == step)


def _same_schedule(got: dict, want: dict) -> bool:
    """Two schedulers' states are equal; where their optimizers hold different numbers of
    parameter groups (FSDP2's: sharded and replicated parameters apart, all on the same
    schedule) each per-group list is compared by its distinct values."""
    if all(len(v) == len(want.get(k, ())) for k, v in got.items() if isinstance(v, list)):
        return got == want
    distinct = lambda state: {k: sorted(set(map(repr, v))) if isinstance(v, list) else v  # noqa: E731
                              for k, v in state.items()}
    return distinct(got) == distinct(want)


def _assert_resumed_on_the_curve(step1: dict, resumed: dict, whole: dict) -> None:
    """`resumed` started from the parameters `step1` (bitwise) and `whole`'s scheduler state
    of step 1, and followed `whole` to step 2."""
    assert resumed["global_step"] == 2
    assert all(torch.equal(resumed["loaded"]["params"][n], p) for n, p in step1.items())
    assert _same_schedule(resumed["loaded"]["scheduler"], whole["scheduler_at"][1])  # the LR of the steps to come
    _close(resumed["after"], whole["params_at"][2])
    assert_loss_close(_loss_at(resumed, 2), _loss_at(whole, 2), 1e-9)
    assert [h["step"] for h in resumed["logs"]] == [1, 2]  # step 1's log from the checkpoint
    assert any((whole["params_at"][2][n] - p).abs().max() > 1e-6 for n, p in whole["params_at"][1].items())


def test_one_process_resume_equals_the_uninterrupted_run(one_process):
    whole = one_process["whole"]
    _assert_resumed_on_the_curve(whole["params_at"][1], one_process["resumed"], whole)
    ck = one_process["root"] / "run" / "checkpoint-1"
    assert (ck / "longstraw_dcp").is_dir() and (ck / "trainer_state.json").is_file()
    assert not (ck / "optimizer.pt").exists()  # the optimizer state is DCP's, not the Trainer's file


def _spawn_checkpoint_job(world: int, context: int, out_dir, job: str = "checkpoint") -> list[dict]:
    out_dir.mkdir()
    codes = spawn_each(worker.rank_main, world, (world, _free_port(), str(out_dir), CASE, context, "", 1, False, 0.0, job),
                       worker.PG_TIMEOUT_S + 300)
    errors = [p.read_text() for p in sorted(out_dir.glob("rank*.err"))]
    assert not errors and codes == [0] * world, (errors, codes)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _check_two_ranks(ranks_dir, ranks: list[dict], context: int, whole: dict, tmp_path, load_at_one=True) -> None:
    """`ranks` (W = 2, C = `context`) against `whole`, one process over the same global batch
    (`load_at_one`: the step-2 checkpoint also loads at W = 1 and trains on)."""
    batch = dict(data_groups=2 // context, prompts_per_group=1)
    for record in ranks:  # interrupted after step 1 at W = 2, resumed at W = 2
        interrupted = record["interrupted"]
        assert interrupted["global_step"] == 1
        _close(interrupted["after"], whole["params_at"][1])
        _assert_resumed_on_the_curve(interrupted["after"], record["resumed"], whole)
    meta = read_meta(str(ranks_dir / "run" / "checkpoint-2"))
    assert meta == {"format": 1, "world": 2, "context_parallel_size": context, "global_step": 2}

    if not load_at_one:
        return
    # the W = 2 checkpoint of step 2 at W = 1: loads the saved state exactly, trains on to step 3
    saved = ranks[0]["resumed"]
    on = _float64(lambda: worker.record_run(CASE, str(tmp_path / "w1"), steps=3,
                                            settings={**worker.CHECKPOINTED, "save_strategy": "no"},
                                            resume=str(ranks_dir / "run" / "checkpoint-2"), **batch))
    assert all(torch.equal(on["loaded"]["params"][n], p) for n, p in saved["after"].items())
    assert on["loaded"]["optim"].keys() == saved["optim"].keys() and saved["optim"]
    for name, state in saved["optim"].items():
        assert all(torch.equal(on["loaded"]["optim"][name][k], v) for k, v in state.items()), name
    assert on["global_step"] == 3
    _close(on["after"], whole["after"])
    assert_loss_close(_loss_at(on, 3), _loss_at(whole, 3), 1e-9)


@pytest.fixture(scope="module")
def two_ranks_one_prompt(tmp_path_factory):
    """W = 2, C = 2: the checkpoint job's folder (`trl_worker.rank_main`, job "checkpoint")."""
    out = tmp_path_factory.mktemp("w2c2") / "ranks"
    _spawn_checkpoint_job(2, 2, out)
    return out


def test_two_ranks_one_prompt_resume_and_load_at_one_process(two_ranks_one_prompt, one_process, tmp_path):
    """W = 2, C = 2."""
    ranks = [torch.load(two_ranks_one_prompt / f"rank{r}.pt", weights_only=False) for r in range(2)]
    _check_two_ranks(two_ranks_one_prompt, ranks, 2, one_process["whole"], tmp_path)


def test_fsdp2_trainer_resumes_on_the_curve_and_loads_at_one_process(one_process, tmp_path):
    """W = 2, C = 2 with `longstraw_fsdp=True`: the decoder layers and their AdamW moments
    are DTensor shards; interrupted after step 1 and resumed at W = 2 it stays on one
    process's curve, its step-2 checkpoint loads at W = 1 without FSDP2 (the optimizer's
    and scheduler's per-mesh parameter groups fitted to one process's two) and trains on to
    the same step 3, and its `from_pretrained` export holds the whole weights."""
    out = tmp_path / "ranks"
    ranks = _spawn_checkpoint_job(2, 2, out, job="fsdp_checkpoint")
    assert all(r["interrupted"]["sharded"] for r in ranks)
    _check_two_ranks(out, ranks, 2, one_process["whole"], tmp_path, load_at_one=True)
    from safetensors.torch import load_file

    exported = load_file(str(out / "run" / "checkpoint-2" / "model.safetensors"))
    saved = ranks[0]["resumed"]["after"]
    assert exported.keys() == saved.keys() or set(exported) <= set(saved), sorted(exported)[:4]
    assert all(torch.equal(exported[n], saved[n]) for n in exported)


@pytest.mark.slow
def test_two_data_parallel_ranks_resume_and_load_at_one_process(tmp_path):
    """W = 2, C = 1: a global batch of two prompts (one per data-parallel group), so its
    own one-process reference."""
    whole = _float64(lambda: worker.record_run(CASE, str(tmp_path / "whole"), steps=3, data_groups=2,
                                               prompts_per_group=1,
                                               settings={**worker.CHECKPOINTED, "save_strategy": "no"}))
    ranks = _spawn_checkpoint_job(2, 1, tmp_path / "ranks")
    _check_two_ranks(tmp_path / "ranks", ranks, 1, whole, tmp_path)


def test_a_checkpoint_of_another_model_is_refused_before_loading(one_process, tmp_path):
    """A LoRA model resumed from the plain model's checkpoint: `CheckpointError` naming the
    missing parameters; no parameter or `.grad` touched."""
    seen = {}

    def prepare(trainer):
        seen.update(trainer=trainer, before={n: p.detach().clone() for n, p in trainer.model.named_parameters()})

    with pytest.raises(CheckpointError, match="written for another model: .* parameters missing"):
        _float64(lambda: worker.record_run("lora_beta", str(tmp_path), prepare=prepare, **ONE_PROMPT,
                                           resume=str(one_process["root"] / "run" / "checkpoint-1")))
    for name, p in seen["trainer"].model.named_parameters():
        assert torch.equal(p, seen["before"][name]) and p.grad is None, name


def test_fsdp2_shards_saved_at_two_ranks_load_at_one(two_ranks_one_prompt):
    """The checkpoint module on FSDP2 state (what the trainer writes once its parameters
    are DTensors): W = 2 ranks each wrote their shards of the parameters and AdamW moments
    (`trl_worker.fsdp2_checkpoint`); one plain process loads them, bitwise the full
    tensors the ranks held."""
    from tests.reference import tiny_model

    out = two_ranks_one_prompt / "fsdp2"
    want = torch.load(out / "full.pt", weights_only=False)
    assert want["sharded"]
    model = tiny_model("qwen3")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    load_model(str(out), model)
    load_optimizer(str(out), model, optimizer, None)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), want["params"][name]), name
    got = {n: optimizer.state[p] for n, p in model.named_parameters()}
    assert got.keys() == want["optim"].keys()
    for name, state in want["optim"].items():
        assert all(torch.equal(torch.as_tensor(got[name][k]), torch.as_tensor(v)) for k, v in state.items()), name


def test_resuming_inside_a_num_iterations_cycle_says_it_generates_again(one_process, tmp_path, caplog):
    """num_iterations=2 reuses step 1's generation batch at step 2; the checkpoint of step
    1 does not hold it, so the resume says that it generates again (stock TRL does too).
    TRL's micro-step counter is set from the restored global step."""
    trainer = _float64(lambda: worker.make_trainer(CASE, str(tmp_path), steps=2, **ONE_PROMPT,
                                                   settings={**worker.CHECKPOINTED, "num_iterations": 2}))
    trainer.create_optimizer_and_scheduler(num_training_steps=2)
    trainer.state.global_step = 1  # what the Trainer restores from trainer_state.json before this hook
    with caplog.at_level("WARNING", logger="longstraw.integrations.trl"):
        trainer._load_optimizer_and_scheduler(str(one_process["root"] / "run" / "checkpoint-1"))
    assert "inside a num_iterations=2 cycle" in caplog.text
    assert trainer._step == 1 * trainer.args.gradient_accumulation_steps  # TRL's micro-step counter, from the step


def test_resume_true_starts_fresh_then_passes_over_a_partial_newest_checkpoint(one_process, tmp_path):
    """`train(resume_from_checkpoint=True)`, the call a torchrun restart repeats: with no
    checkpoint yet it starts from step 0 (the Trainer alone raises); with a newest
    checkpoint-2 that a kill left partial (no `longstraw_complete`, no trainer state) it
    resumes from the complete checkpoint-1 onto the uninterrupted curve. Every checkpoint
    the Trainer finished is marked complete."""
    import shutil

    from longstraw.integrations.trl_checkpoint import COMPLETE_FILE, last_complete_checkpoint

    run = one_process["root"] / "run"
    assert all((run / f"checkpoint-{s}" / COMPLETE_FILE).exists() for s in (1, 2, 3))
    assert last_complete_checkpoint(str(run)) == str(run / "checkpoint-3")
    fresh = _float64(lambda: worker.record_run(CASE, str(tmp_path / "fresh"), steps=1, settings=worker.CHECKPOINTED,
                                               resume=True, **ONE_PROMPT))
    assert fresh["global_step"] == 1
    assert all(torch.equal(fresh["loaded"]["params"][n], p) for n, p in one_process["whole"]["before"].items())
    killed = tmp_path / "killed" / "run"
    for step in (1, 2):
        shutil.copytree(run / f"checkpoint-{step}", killed / f"checkpoint-{step}")
    (killed / "checkpoint-2" / COMPLETE_FILE).unlink()
    (killed / "checkpoint-2" / "trainer_state.json").unlink()  # killed before the Trainer's last file
    assert last_complete_checkpoint(str(killed)) == str(killed / "checkpoint-1")
    resumed = _float64(lambda: worker.record_run(CASE, str(tmp_path / "killed"), steps=3,
                                                 settings=worker.CHECKPOINTED, resume=True, stop_after=2,
                                                 **ONE_PROMPT))
    _assert_resumed_on_the_curve(one_process["whole"]["params_at"][1], resumed, one_process["whole"])


def test_a_kill_between_the_save_and_its_marker_keeps_the_last_complete_checkpoint(tmp_path, monkeypatch):
    """`save_total_limit=1`: the Trainer's rotation used to run inside its save, before
    LongStraw's barrier and marker, so a kill there left no complete checkpoint (and resume
    took the newest unmarked one). Killed at step 2's marker (raised where it is written):
    checkpoint-1 is still there and complete, resume picks it, never the unmarked
    checkpoint-2; an uninterrupted save rotates after its marker."""
    from longstraw.integrations import trl_checkpoint
    from longstraw.integrations.trl_checkpoint import last_complete_checkpoint

    class Killed(BaseException):
        pass

    marks = []
    real = trl_checkpoint.write_atomic

    def marker(path, write):
        marks.append(path)
        if len(marks) == 2:
            raise Killed(path)  # the kill: after checkpoint-2's files, before its marker
        return real(path, write)

    monkeypatch.setattr(trl_checkpoint, "write_atomic", marker)
    settings = dict(worker.CHECKPOINTED, save_total_limit=1)
    with pytest.raises(Killed):
        _float64(lambda: worker.record_run(CASE, str(tmp_path), steps=2, settings=settings, **ONE_PROMPT))
    run = tmp_path / "run"
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-1", "checkpoint-2"]
    assert last_complete_checkpoint(str(run)) == str(run / "checkpoint-1")
    monkeypatch.setattr(trl_checkpoint, "write_atomic", real)
    (tmp_path / "run" / "checkpoint-1" / trl_checkpoint.COMPLETE_FILE).unlink()
    assert last_complete_checkpoint(str(run)) is None  # no marked folder: a fresh start, not an unmarked one
    whole = tmp_path / "whole"
    _float64(lambda: worker.record_run(CASE, str(whole), steps=2, settings=settings, **ONE_PROMPT))
    assert sorted(p.name for p in (whole / "run").iterdir() if p.name.startswith("checkpoint-")) == ["checkpoint-2"]
