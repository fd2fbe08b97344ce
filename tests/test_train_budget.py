"""`longstraw train --memory-budget` (`longstraw/train_budget.py`): the loop's engine runs
`ls.fit_config`'s choice for the run's model and step, keeps what the user set, prints
it, and a budget that nothing fits stops the run with a clear message before any work."""

import json

import pytest

import longstraw as ls
from longstraw import train as train_module
from longstraw.cli import main
from longstraw.train import TrainConfig, build_model
from longstraw.train_budget import TRAIN_CHUNK_SIZE, engine_config

MiB = 2**20
# P = 16,384 on the dense preset (hidden 64, 2 layers), exact mode: 1 GiB trades nothing,
# 40 MiB needs a smaller capture chunk, 20 MiB fits nothing (the leanest step adds ~20.9 MB)
STEP = dict(prompt_tokens=16384, group_size=8, arm="exact", warm_steps=0, progress=False)


def _fit(cfg: TrainConfig) -> ls.ExecConfig:
    held = cfg.prompts_per_step - 1 + (1 if cfg.log_kl else 0)  # log_kl: the reference's own state, held too
    return ls.fit_config(build_model(cfg), memory_budget=cfg.memory_budget, prompt_tokens=cfg.prompt_tokens,
                         group=cfg.group_size, response_tokens=cfg.task().response_tokens, mode="exact",
                         context_parallel=False, held_states=held, generate=True)


def test_the_reference_state_of_log_kl_is_held_in_the_budget(monkeypatch):
    """Issue 43 item 6: with `log_kl` (the default) the reference captures its own state of
    the prompt while every rollout's state is held: one held state more than the rollouts'
    others (before: `prompts_per_step - 1` only)."""
    from longstraw import train_budget

    seen = []
    monkeypatch.setattr(train_budget, "fit_config", lambda model, **kw: seen.append((kw["held_states"], kw["generate"])))
    for log_kl, prompts in ((True, 1), (False, 1), (True, 3), (False, 3)):
        cfg = TrainConfig(**STEP, memory_budget="1GiB", log_kl=log_kl, prompts_per_step=prompts)
        engine_config(cfg, None, mode="exact", context_parallel=False)
    assert seen == [(1, True), (0, True), (3, True), (2, True)]  # the loop's rollouts generate (item 6e)


def test_the_budget_chooses_the_engine_config_and_given_options_are_kept():
    roomy, tight = (TrainConfig(**STEP, memory_budget=b) for b in ("1GiB", "40MiB"))
    got = {c.memory_budget: engine_config(c, build_model(c), mode="exact", context_parallel=False) for c in (roomy, tight)}
    assert got["1GiB"] == _fit(roomy) and got["40MiB"] == _fit(tight)
    assert got["40MiB"].chunk_size < got["1GiB"].chunk_size  # the tight budget needed a smaller chunk
    pinned = TrainConfig(**STEP, memory_budget="1GiB", chunk_size=256)
    assert engine_config(pinned, build_model(pinned), mode="exact", context_parallel=False).chunk_size == 256
    plain = TrainConfig(**STEP)  # no budget: the loop's own config, as before
    assert engine_config(plain, None, mode="exact", context_parallel=False) == ls.ExecConfig(
        chunk_size=TRAIN_CHUNK_SIZE, mode="exact")


def test_bad_budgets_are_refused_at_construction():
    for bad in ("lots", "0", "auto"):  # the loop runs on CPU: no free CUDA memory to read
        with pytest.raises(ls.ConfigError, match="memory_budget"):
            TrainConfig(**STEP, memory_budget=bad)


def test_train_runs_the_fitted_config_and_prints_it(tmp_path, capsys, monkeypatch):
    seen = []
    real = train_module.Engine
    monkeypatch.setattr(train_module, "Engine", lambda model, config: seen.append(config) or real(model, config))
    flags = ["--prompt-tokens", "64", "--num-facts", "1", "--num-values", "1", "--num-keys", "2", "--num-filler",
             "4", "--warm-steps", "0", "--steps", "1", "--group-size", "2", "--eval-prompts", "1", "--no-log-kl",
             "--no-progress", "--threads", "1", "--memory-budget", "20MiB", "--out-dir", str(tmp_path / "run")]
    assert main(["train", *flags]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    cfg = TrainConfig(prompt_tokens=64, num_facts=1, num_values=1, num_keys=2, num_filler=4, warm_steps=0,
                      group_size=2, memory_budget="20MiB", log_kl=False)
    assert seen == [_fit(cfg)]
    assert out[0].startswith("longstraw train: memory_budget='20MiB' fits ExecConfig(")
    assert f"chunk_size={seen[0].chunk_size}" in out[0] and "mode='exact'" in out[0]
    assert json.loads(out[-1])["step"] == 1


def test_a_budget_nothing_fits_stops_before_any_work(tmp_path, capsys, monkeypatch):
    calls = []
    monkeypatch.setattr(train_module, "warm_model", lambda cfg: calls.append(cfg))
    flags = ["--prompt-tokens", "16384", "--warm-steps", "0", "--no-progress", "--memory-budget", "20MiB",
             "--out-dir", str(tmp_path / "run")]
    assert main(["train", *flags]) == 2
    err = capsys.readouterr().err
    assert "DoesNotFitError" in err and "memory_budget='20MiB'" in err and "binding term" in err
    assert "The smallest budget that fits: --memory-budget " in err and " GiB)" in err  # this command's flags
    assert "memory_budget=" not in err.split("The smallest budget")[1]
    assert calls == [] and not (tmp_path / "run").exists()  # no warm start, not even the out_dir

