"""The `longstraw` command's own logic (the library is tested elsewhere)."""

import torch

from longstraw import cli


def test_torchrun_with_cuda_picks_nccl_on_the_local_rank_device(monkeypatch):
    import torch.distributed as dist

    seen = {}
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.setdefault("set_device", d))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.setdefault("backend", backend))
    monkeypatch.setattr(dist, "get_rank", lambda: 3)
    rank, device = cli._init_torchrun()
    assert (rank, device, seen["backend"], seen["set_device"]) == (3, torch.device("cuda", 3), "nccl", device)


def test_without_torchrun_the_demo_stays_on_cpu(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert cli._init_torchrun() == (None, torch.device("cpu"))


def test_progress_shows_one_bar_per_phase_and_none_per_piece(capsys):
    import longstraw as ls
    from longstraw.tiny import tiny_model
    from tests.reference import uniform_group

    model = tiny_model("qwen3", num_hidden_layers=1)
    group = uniform_group(model.config.vocab_size, 64, 2, 12, seed=0)
    engine = ls.Engine(model, ls.ExecConfig(chunk_size=32, branch_chunk_size=4, mode="exact", progress=True))
    engine.step(group, ls.GRPOConfig())
    err = capsys.readouterr().err
    assert "capture" in err and "replay" in err and "reverse" in err
    assert "pieces" not in err  # a branch's pieces run inside the replay bar


def test_naive_estimate_drops_only_hf_kernel_fallback_warnings(caplog):
    import logging

    from longstraw.measure import without_hf_kernel_fallback_warning

    hf = logging.getLogger("transformers.integrations.hub_kernels")
    fallback = ("`chunk_gated_delta_rule` is falling back to its reference PyTorch implementation because "
                "`flash-linear-attention` is not installed.")
    with caplog.at_level(logging.WARNING, logger=hf.name), without_hf_kernel_fallback_warning():
        hf.warning(fallback)
        hf.warning("something else")
    assert [r.getMessage() for r in caplog.records] == ["something else"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=hf.name):
        hf.warning(fallback)  # outside the estimate it is left alone
    assert [r.getMessage() for r in caplog.records] == [fallback]


def test_train_flags_carry_their_fields_docstrings(capsys):
    """`longstraw train --help` explains each flag with the TrainConfig field's docstring."""
    import dataclasses

    import pytest

    from longstraw.cli import field_docs, main
    from longstraw.train import TrainConfig

    docs = field_docs(TrainConfig)
    assert "one capture" in docs["kl_prompts"] and "P of the RL prompts" in docs["prompt_tokens"]
    documented = [f.name for f in dataclasses.fields(TrainConfig) if f.name in docs]
    assert len(documented) >= len(dataclasses.fields(TrainConfig)) // 2
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "estimated on (0: all of them)" in out


def test_train_runs_the_agent_task_through_its_environment(tmp_path, capsys):
    """`longstraw train --task tool_lookup` trains on agent episodes: the log counts the
    tool calls its rollouts made through engine.generate(environment=)."""
    import json
    import warnings

    from longstraw.cli import main
    from longstraw.skips import NoUpdateWarning

    out = tmp_path / "run"
    flags = ["--task", "tool_lookup", "--prompt-tokens", "24", "--num-facts", "2", "--num-values", "2",
             "--num-answers", "2", "--num-keys", "2", "--num-filler", "4", "--warm-steps", "40",
             "--warm-min-prompt-tokens", "16", "--warm-prompt-tokens", "16", "--warm-batch", "8", "--warm-lr", "0.01",
             "--steps", "2", "--group-size", "4", "--eval-every", "2", "--eval-prompts", "2", "--chunk-size", "8",
             "--no-log-kl", "--no-progress", "--threads", "1", "--out-dir", str(out)]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # as -W always: no warning but ours reaches the screen (quiet.py)
        assert main(["train", *flags]) == 0
    assert all(issubclass(w.category, NoUpdateWarning) for w in seen), [str(w.message) for w in seen]
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    log = [json.loads(line) for line in open(out / "log.jsonl")]
    assert json.load(open(out / "config.json"))["task_name"] == "tool_lookup"
    assert summary["environment_calls"] == log[-1]["environment_calls"]
    assert sum(r["environment_calls"] for r in log[1:]) > 0


def test_plan_command_runs_without_torch():
    """`longstraw plan` imports no torch: run it with torch blocked."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None\n"
            "from longstraw.cli import main\n"
            "sys.exit(main(['plan', '--model', 'qwen3-8b', '--prompt-tokens', '65536', '--group', '4',"
            " '--response-tokens', '256', '--json']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert '"peak_bytes_per_rank"' in proc.stdout


def _refused(capsys, flags):
    """Run `longstraw train` with `flags`: its exit code and its stderr's lines."""
    from longstraw.cli import main

    code = main(["train", *flags])
    return code, capsys.readouterr().err.strip().splitlines()


def test_train_refuses_an_unknown_model_arm_or_task_in_one_line(tmp_path, capsys):
    """--model / --arm / --task outside their choices: one `longstraw: ConfigError:` line, exit 2,
    naming the choices; no traceback, and --help lists them."""
    import pytest

    from longstraw.cli import main

    for flag, bad, choice in (("--model", "nope", "dense"), ("--arm", "foo", "detached"),
                              ("--task", "foo", "tool_lookup")):
        with pytest.raises(SystemExit) as exc:
            main(["train", flag, bad, "--out-dir", str(tmp_path / "run")])
        err = capsys.readouterr().err.strip().splitlines()
        assert exc.value.code == 2 and len(err) == 1, err
        assert err[0].startswith("longstraw: ConfigError: ") and bad in err[0] and choice in err[0], err
    assert not (tmp_path / "run").exists()
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--model {dense}" in out and "--arm {detached,exact}" in out and "kv_recall,tool_lookup" in out


def test_train_refuses_an_unknown_model_from_a_config_file_in_one_line(tmp_path, capsys):
    """The same field from --config (no argparse choices there): TrainConfig's ConfigError, one line, exit 2."""
    import json

    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"model": "nope"}))
    code, err = _refused(capsys, ["--config", str(path), "--out-dir", str(tmp_path / "run")])
    assert code == 2 and len(err) == 1 and err[0].startswith("longstraw: ConfigError: ") and "nope" in err[0], err


def test_train_refuses_a_bad_loss_type_before_the_warm_start(tmp_path, capsys, monkeypatch):
    """--loss-type ppo: refused before the warm start runs and before config.json is written."""
    import pytest

    import longstraw.train as train_mod
    from longstraw.cli import main
    from longstraw.errors import ConfigError

    monkeypatch.setattr(train_mod, "warm_model", lambda cfg: pytest.fail("the warm start ran"))
    with pytest.raises(SystemExit) as exc:
        main(["train", "--loss-type", "ppo", "--out-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and err[0].startswith("longstraw: ConfigError: "), err
    assert "ppo" in err[0] and "dapo" in err[0]
    with pytest.raises(ConfigError, match="loss_type"):
        train_mod.TrainConfig(loss_type="ppo")  # from Python too, before any work
    assert not (tmp_path / "run").exists()


TINY_TRAIN = ["--prompt-tokens", "16", "--num-facts", "1", "--num-values", "2", "--num-keys", "2", "--num-filler", "4",
              "--warm-steps", "0", "--steps", "2", "--group-size", "4", "--eval-every", "2", "--eval-prompts", "2",
              "--chunk-size", "8", "--no-log-kl", "--no-progress", "--threads", "1"]


def test_train_rerun_on_a_finished_out_dir_says_so(tmp_path, capsys, monkeypatch):
    """A second `longstraw train` on a finished --out-dir: exit 0, says it is finished and how
    to start over (not `{}`), prints the run's last record, and builds no model."""
    import json

    import pytest

    import longstraw.train as train_mod
    from longstraw.cli import main

    flags = [*TINY_TRAIN, "--out-dir", str(tmp_path / "run")]
    assert main(["train", *flags]) == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    monkeypatch.setattr(train_mod, "warm_model", lambda cfg: pytest.fail("a finished run built its model again"))
    assert main(["train", *flags]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out.strip().splitlines()[-1]) == first and first["step"] == 2
    assert "finished" in err and "--no-resume" in err and "--steps" in err, err
