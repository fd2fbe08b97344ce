"""`longstraw grpo` (longstraw/grpo_cli.py): TRL's GRPO script flags, LongStraw's trainer.

A tiny Qwen3 model and a word-level tokenizer are built in code and saved with
`save_pretrained` (nothing downloaded), with a JSONL of prompts and a reward file; the
command trains, saves a `from_pretrained`-able model, and resumes. Each bad input is a
one-line `longstraw: ConfigError: ...` with exit 2, before any model is loaded.
"""

import json

import pytest
import torch

from longstraw import cli
from tests.reference import tiny_model

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
from transformers import AutoModelForCausalLM  # noqa: E402

from longstraw import grpo_cli  # noqa: E402
from longstraw.integrations.trl import token_id_tokenizer  # noqa: E402
from longstraw.integrations.vlm_processor import load_tokenizer  # noqa: E402

VOCAB, EOS, POSITIONS = 97, 1, 64

REWARD_FILE = '''
def even_tokens(completion_ids, **kwargs):
    return [sum(t % 2 == 0 for t in c) / max(len(c), 1) for c in completion_ids]


def uses_answer(completions, answer, **kwargs):
    return [float(str(a) in c) for c, a in zip(completions, answer)]


def bad_signature(text):
    return [0.0]
'''


def _prompts(n, length=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [" ".join(str(int(t)) for t in torch.randint(2, VOCAB, (length,), generator=g)) for _ in range(n)]


@pytest.fixture
def workspace(tmp_path):
    """A saved tiny model + tokenizer, a JSONL dataset, a reward file: the user's files."""
    model = tiny_model("qwen3", dtype=torch.float32, max_position_embeddings=POSITIONS)
    model.save_pretrained(tmp_path / "model")
    token_id_tokenizer(VOCAB, eos_token_id=EOS).save_pretrained(tmp_path / "model")
    with open(tmp_path / "data.jsonl", "w") as f:
        for i, p in enumerate(_prompts(6)):
            f.write(json.dumps({"prompt": p, "answer": i % 3}) + "\n")
    (tmp_path / "rewards.py").write_text(REWARD_FILE)
    return tmp_path


def _flags(ws, *extra, out="out", data="data.jsonl", reward="even_tokens", spec=None, steps=3):
    return ["grpo", "--model_name_or_path", str(ws / "model"), "--dataset_name", str(ws / data),
            "--reward_funcs", spec or f"{ws / 'rewards.py'}:{reward}", "--output_dir", str(ws / out),
            "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "4",
            "--max_steps", str(steps), "--learning_rate", "5e-2", "--use_cpu", "--report_to", "none",
            "--save_strategy", "steps", "--save_steps", "1", "--logging_steps", "1", "--seed", "0",
            "--longstraw_chunk_size", "4", *extra]


def _state(folder):
    return json.loads((folder / "trainer_state.json").read_text())


def test_trains_saves_and_resumes(workspace):
    ws = workspace
    assert cli.main(_flags(ws)) == 0
    before = AutoModelForCausalLM.from_pretrained(ws / "model")
    after = AutoModelForCausalLM.from_pretrained(ws / "out")
    changed = [n for n, p in after.state_dict().items() if not torch.equal(p, before.state_dict()[n])]
    assert changed, "training changed no weight"
    assert (ws / "out" / "tokenizer.json").exists()  # the tokenizer is saved with the model
    assert _state(ws / "out" / "checkpoint-3")["global_step"] == 3

    assert cli.main(_flags(ws, "--resume_from_checkpoint", str(ws / "out" / "checkpoint-3"), steps=4)) == 0
    state = _state(ws / "out" / "checkpoint-4")
    assert state["global_step"] == 4
    assert [h["step"] for h in state["log_history"] if "loss" in h] == [1, 2, 3, 4]  # 4 is the resumed run's


def test_yaml_config_and_longstraw_flags_reach_the_trainer(workspace, tmp_path):
    (tmp_path / "grpo.yaml").write_text("weight_decay: 0.125\nlearning_rate: 9.0\nloss_type: grpo\nlongstraw_mode: exact\n"
                                        "longstraw_keep_states: false\n")
    argv = _flags(workspace, "--config", str(tmp_path / "grpo.yaml"), "--beta", "0.0")[1:]
    script, training, model_args, data_args, ls_args = grpo_cli.parse(argv)
    trainer = grpo_cli.build_trainer(script, training, model_args, data_args, ls_args)
    assert trainer.args.weight_decay == 0.125 and trainer.args.loss_type == "grpo"
    assert trainer.args.learning_rate == 5e-2  # a flag overrides the file, as in TRL
    assert trainer.args.bf16 is False  # LongStraw's default: the model's own dtype
    assert trainer.longstraw_engine.config.mode == "exact" and trainer.longstraw_keep_states is False
    assert trainer.longstraw_engine.config.chunk_size == 4


def test_memory_budget_flag_fits_the_engine_for_the_longest_prompt(workspace):
    """--longstraw_memory_budget reaches the trainer's `fit_config`, for the dataset's
    longest prompt (9 tokens) unless --longstraw_prompt_tokens says otherwise."""
    trainer = grpo_cli.build_trainer(*grpo_cli.parse(_flags(workspace, "--longstraw_memory_budget", "4GiB")[1:]))
    assert trainer.longstraw_memory_budget == "4GiB" and trainer.longstraw_prompt_tokens == 9
    argv = _flags(workspace, "--longstraw_memory_budget", "4GiB", "--longstraw_prompt_tokens", "40")[1:]
    assert grpo_cli.build_trainer(*grpo_cli.parse(argv)).longstraw_prompt_tokens == 40


def test_trl_reward_names_are_trl_functions():
    from trl.rewards import accuracy_reward, think_format_reward

    assert grpo_cli.load_reward_funcs(["think_format_reward", "accuracy_reward"], ["prompt", "solution"]) == [
        think_format_reward, accuracy_reward]


def test_peft_flags_build_a_lora_model(workspace):
    argv = _flags(workspace, "--use_peft", "--lora_r", "4", "--lora_target_modules", "q_proj", "v_proj")[1:]
    trainer = grpo_cli.build_trainer(*grpo_cli.parse(argv))
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def _error(capsys, argv) -> str:
    assert cli.main(argv) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("longstraw:")]
    assert len(lines) == 1 and lines[0].startswith("longstraw: ConfigError: "), lines  # one line (datasets' bars aside)
    return lines[0]


def test_bad_inputs_are_one_line_errors_before_the_model_loads(workspace, capsys, monkeypatch):
    ws = workspace

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(trl.trainer.grpo_trainer, "create_model_from_path", no_model)
    (ws / "noprompt.jsonl").write_text('{"question": "1 2 3"}\n')
    (ws / "empty.jsonl").write_text("")
    (ws / "long.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n"
                                          for p in ["2 3", " ".join(["5"] * 70), "4 4 4"]))
    assert "no 'prompt' column" in _error(capsys, _flags(ws, data="noprompt.jsonl"))
    assert "['question']" in _error(capsys, _flags(ws, data="noprompt.jsonl"))
    assert "the file is empty: nothing to train on; add rows" in _error(capsys, _flags(ws, data="empty.jsonl"))
    (ws / "empty_split").mkdir()
    datasets.DatasetDict(train=datasets.Dataset.from_dict({"prompt": ["2 3"]}).filter(lambda e: False)).save_to_disk(ws / "empty_split" / "d")
    err = _error(capsys, _flags(ws, data="empty_split/d"))
    assert "'train' split is empty" in err and "add rows" in err and "--dataset_train_split" in err
    err = _error(capsys, _flags(ws, data="long.jsonl"))
    assert "prompt 1 (the longest) has 70 tokens" in err and "max_position_embeddings=64" in err
    assert "1 of 3" in err
    err = _error(capsys, _flags(ws, reward="missing"))
    assert "has no 'missing'; its functions: ['bad_signature', 'even_tokens', 'uses_answer']" in err
    assert "wrong signature" in _error(capsys, _flags(ws, reward="bad_signature"))
    (ws / "broken.py").write_text("import not_a_module_anywhere\n")
    err = _error(capsys, _flags(ws, spec=f"{ws / 'broken.py'}:f"))
    assert "importing" in err and "not_a_module_anywhere" in err and "fix that error" in err
    assert "no_such_module" in _error(capsys, _flags(ws, spec="no_such_module:f"))
    assert "not one of TRL's" in _error(capsys, _flags(ws, spec="no_colon_or_dot"))
    err = _error(capsys, _flags(ws, "--not_a_flag", "3"))
    assert "--not_a_flag" in err and "not a flag" in err
    assert "no such file" in _error(capsys, _flags(ws, data="nothing.jsonl"))
    assert cli.main(_flags(ws, "--use_vllm", "True")) == 2  # the trainer's refusals (a list): exit 2 too
    assert "longstraw: ConfigError: LongStrawGRPOTrainer cannot run" in capsys.readouterr().err


def test_chat_prompts_need_a_chat_template_and_are_measured_with_it(workspace, capsys):
    from longstraw.integrations.chat import tool_chat_tokenizer

    ws = workspace
    chats = [[{"role": "user", "content": "2 3 4"}], [{"role": "user", "content": "5 6 7 8 9"}]]
    (ws / "chat.jsonl").write_text("".join(json.dumps({"prompt": c}) + "\n" for c in chats))
    err = _error(capsys, _flags(ws, data="chat.jsonl"))
    assert "the prompts are chat messages, but the tokenizer" in err and "has no chat template" in err
    tokenizer = tool_chat_tokenizer(VOCAB)
    tokenizer.save_pretrained(ws / "model")
    checked = grpo_cli.check_inputs(*grpo_cli.parse(_flags(ws, data="chat.jsonl")[1:])[:4])
    rendered = tokenizer.apply_chat_template(chats[1], add_generation_prompt=True, tokenize=True, return_dict=True)
    assert checked.longest_prompt == len(rendered["input_ids"]) > 5  # the template's tokens counted


def test_reward_signature_check():
    columns = ["prompt", "answer"]
    grpo_cli.check_reward_signature("ok", lambda completions, answer, **kw: None, columns)
    grpo_cli.check_reward_signature("ok", lambda prompts, completions, completion_ids, answer, trainer_state,
                                    log_extra, log_metric: None, columns)
    with pytest.raises(grpo_cli.ConfigError, match=r"needs \['solution'\]"):
        grpo_cli.check_reward_signature("f", lambda completions, solution, **kw: None, columns)
    with pytest.raises(grpo_cli.ConfigError, match="add \\*\\*kwargs"):
        grpo_cli.check_reward_signature("f", lambda completions, answer: None, columns)


def test_dataset_formats(tmp_path):
    rows = {"prompt": ["1 2", "3 4"], "answer": [1, 2]}
    ds = datasets.Dataset.from_dict(rows)
    ds.to_json(tmp_path / "d.json")
    ds.to_parquet(tmp_path / "d.parquet")
    ds.to_csv(tmp_path / "d.csv", index=False)
    ds.save_to_disk(tmp_path / "saved")
    datasets.DatasetDict(train=ds, test=ds).save_to_disk(tmp_path / "saved_dict")
    for name in ("d.json", "d.parquet", "d.csv", "saved", "saved_dict"):
        train = grpo_cli.train_split(grpo_cli.load_local_or_hub_dataset(str(tmp_path / name)), "train")
        assert train["prompt"] == rows["prompt"], name
    with pytest.raises(grpo_cli.ConfigError, match=r"splits \['test', 'train'\]"):
        grpo_cli.train_split(grpo_cli.load_local_or_hub_dataset(str(tmp_path / "saved_dict")), "validation")


class _Recorded:
    """What the first optimizer step saw: its gradients (and, after training, the logged loss)."""

    grads: list = []


def _recording(trainer_cls):
    """`trainer_cls` whose every optimizer step's gradients land in `_Recorded.grads`."""

    class Grads(trl.trainer.grpo_trainer.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            _Recorded.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()
                                    if p.grad is not None})

    class Recording(trainer_cls):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self.add_callback(Grads())
            _Recorded.trainer = self

    return Recording


def test_first_step_equals_trl_script_with_the_trainer_swapped_in(workspace, monkeypatch):
    """float64: `longstraw grpo` and TRL's own `trl/scripts/grpo.py` main, with
    `trl.GRPOTrainer` replaced by `LongStrawGRPOTrainer` by hand, agree on the first
    step's loss and every gradient (same flags, same dotted reward, same data folder)."""
    from trl.scripts import grpo as trl_grpo

    from longstraw.config import ExecConfig
    from longstraw.integrations.trl import LongStrawGRPOTrainer

    ws = workspace
    tiny_model("qwen3", dtype=torch.float64, max_position_embeddings=POSITIONS).save_pretrained(ws / "model")
    (ws / "data").mkdir()
    (ws / "data.jsonl").rename(ws / "data" / "train.jsonl")
    monkeypatch.chdir(ws)  # TRL imports a dotted reward from the working directory
    common = ["--model_name_or_path", str(ws / "model"), "--dataset_name", str(ws / "data"),
              "--reward_funcs", "rewards.even_tokens", "--per_device_train_batch_size", "4",
              "--num_generations", "4", "--max_completion_length", "4", "--max_steps", "1", "--learning_rate", "0.1",
              "--use_cpu", "--report_to", "none", "--save_strategy", "no", "--logging_steps", "1", "--seed", "0",
              "--dtype", "auto"]
    runs = {}
    for name in ("trl", "longstraw"):
        _Recorded.grads = []
        out = ["--output_dir", str(ws / name)]
        if name == "trl":
            class Swapped(LongStrawGRPOTrainer):  # what a TRL user writes: the one class changed
                def __init__(self, *a, **k):
                    super().__init__(*a, longstraw_config=ExecConfig(chunk_size=4), **k)

            monkeypatch.setattr(trl, "GRPOTrainer", _recording(Swapped))
            parsed = trl_grpo.make_parser().parse_args_and_config(
                args=common + out + ["--bf16", "False", "--disable_dropout", "True"])
            trl_grpo.main(*parsed)
        else:
            monkeypatch.setattr(grpo_cli, "LongStrawGRPOTrainer", _recording(LongStrawGRPOTrainer))
            assert cli.main(["grpo", *common, *out, "--longstraw_chunk_size", "4"]) == 0
        trainer = _Recorded.trainer
        assert next(trainer.model.parameters()).dtype == torch.float64
        loss = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        runs[name] = (loss, _Recorded.grads)
    (trl_loss, trl_grads), (ls_loss, ls_grads) = runs["trl"], runs["longstraw"]
    assert len(trl_grads) == len(ls_grads) == 1 and trl_loss and len(trl_loss) == len(ls_loss)
    assert ls_loss[0] == pytest.approx(trl_loss[0], rel=1e-12, abs=1e-15)
    assert trl_grads[0].keys() == ls_grads[0].keys() and trl_grads[0]
    assert any(g.abs().max() > 0 for g in ls_grads[0].values())
    for n, g in trl_grads[0].items():
        torch.testing.assert_close(ls_grads[0][n], g, rtol=1e-12, atol=1e-15, msg=n)


def test_token_id_tokenizer_keeps_numbers_that_contain_the_eos_digits(tmp_path):
    """eos "1" is a special token: it must not split "2100" or "12" (whole words only), also after a reload."""
    tok = token_id_tokenizer(4096, eos_token_id=1)
    tok.save_pretrained(tmp_path)
    for t in (tok, load_tokenizer(str(tmp_path))):  # as `longstraw grpo` loads it
        assert t("2100 12 7 1 11")["input_ids"] == [2100, 12, 7, 1, 11]


@pytest.mark.slow
def test_torchrun_two_ranks_context_parallel(workspace):
    """`torchrun --nproc-per-node 2 -m longstraw.cli grpo ... --longstraw_context_parallel_size 2`
    (gloo, CPU): one prompt over both ranks, 3 steps, a from_pretrained-able output_dir
    whose weights moved; a second launch resumes checkpoint-3 and continues at step 4."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    def torchrun(*extra, steps):
        flags = _flags(workspace, "--longstraw_context_parallel_size", "2", *extra, steps=steps)[1:]
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                              "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "longstraw.cli", "grpo",
                              *flags], env={**os.environ, "PYTHONPATH": repo, "HF_HUB_OFFLINE": "1"},
                             capture_output=True, text=True, timeout=900)
        assert run.returncode == 0, run.stderr[-4000:]

    torchrun(steps=3)
    before = AutoModelForCausalLM.from_pretrained(workspace / "model").state_dict()
    after = AutoModelForCausalLM.from_pretrained(workspace / "out").state_dict()
    assert any(not torch.equal(p, before[n]) for n, p in after.items())
    assert _state(workspace / "out" / "checkpoint-3")["global_step"] == 3
    torchrun("--resume_from_checkpoint", str(workspace / "out" / "checkpoint-3"), steps=4)
    state = _state(workspace / "out" / "checkpoint-4")
    assert state["global_step"] == 4
    assert [h["step"] for h in state["log_history"] if "loss" in h] == [1, 2, 3, 4]
