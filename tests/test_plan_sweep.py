"""`longstraw plan --sweep FIELD=V1,... [--fit] [--plot FILE.png]` (`plan/sweep.py`): one row
per value, each the plan (or the fit) at that value; a PNG when asked; bad sweeps are
clear errors."""

import json

import pytest

from longstraw.cli import main
from longstraw.errors import ConfigError
from longstraw.plan import PlanConfig, estimate
from longstraw.plan.sweep import parse_sweep, sweep

ARGS = ["plan", "--model", "qwen3-8b", "--prompt-tokens", "131072", "--group", "4", "--response-tokens", "1024",
        "--gpu", "h100", "--lora-rank", "16"]


def test_each_row_is_the_plan_at_its_value(capsys):
    assert main(ARGS + ["--sweep", "gpus=1,2,4,16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sweep"] == "gpus" and [r["gpus"] for r in out["rows"]] == [1, 2, 4, 16]
    for row in out["rows"]:
        r = estimate("qwen3-8b", PlanConfig(prompt_tokens=131072, group=4, response_tokens=1024, gpu="h100",
                                            lora_rank=16, gpus=row["gpus"]))
        assert row["peak_bytes_per_rank"] == int(r["peak_bytes_per_rank"]) and row["time_s"] == r["estimated_time_s"]
        assert 0 <= row["comm_share"] < 1
    # 16 ranks span two 8-GPU nodes: communication shows in the time
    assert out["rows"][-1]["comm_share"] > out["rows"][1]["comm_share"]


def test_a_fit_sweep_fits_each_value_or_names_the_binding_term():
    rows = sweep("qwen3-8b", PlanConfig(prompt_tokens=1, gpu_memory="20GiB", lora_rank=16), "prompt_tokens",
                 [65536, 1 << 24], fit=True)
    assert rows[0]["fits"] and rows[0]["flags"] and not rows[1]["fits"] and rows[1]["binding"]


@pytest.mark.slow  # matplotlib's import alone is a few seconds here
def test_the_plot(tmp_path, capsys):
    png = tmp_path / "sweep.png"
    assert main(ARGS + ["--gpu-memory", "20GiB", "--fit", "--sweep", "prompt_tokens=65536,262144",
                        "--plot", str(png)]) == 0
    assert "--mode detached" in capsys.readouterr().out and png.stat().st_size > 10_000


@pytest.mark.parametrize("bad", ["gpus", "gpus=", "chunk=4", "gpus=a,b"])
def test_bad_sweeps_are_clear_errors(bad):
    with pytest.raises(ConfigError, match="sweep"):
        parse_sweep(bad)
