"""examples/your_model/make_files.py: the files made offline, and its one `longstraw grpo`
command run for 2 steps in a fresh process (-m slow: a subprocess and a 4096-token vocab)."""

import json
import os
import subprocess
import sys

import pytest
from transformers import AutoModelForCausalLM

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_example_makes_files_and_trains(tmp_path):
    env = {**os.environ, "PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, os.path.join(REPO, "examples", "your_model", "make_files.py"),
                          "--dir", str(tmp_path), "--prompt-tokens", "128", "--prompts", "4", "--steps", "2",
                          "--chunk-size", "64", "--run"], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith("longstraw grpo --model_name_or_path")
    rows = [json.loads(line) for line in open(tmp_path / "prompts.jsonl")]
    assert len(rows) == 4 and all(len(r["prompt"].split()) == 128 and 2100 <= r["answer"] < 2116 for r in rows)
    state = json.loads((tmp_path / "out" / "checkpoint-2" / "trainer_state.json").read_text())
    logged = [h for h in state["log_history"] if "loss" in h]
    assert [h["step"] for h in logged] == [1, 2] and all("rewards/first_token_is_answer/mean" in h for h in logged)
    AutoModelForCausalLM.from_pretrained(tmp_path / "out")
