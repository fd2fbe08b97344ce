"""bench/gpu_suite.py: its --cpu smoke run passes every check, and a failing check is
reported without stopping the suite."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from bench import gpu_suite  # noqa: E402


def test_a_failing_check_is_reported_and_the_suite_goes_on(tmp_path, monkeypatch):
    (tmp_path / "fake_check.py").write_text('print("a table")\nprint(\'{"all_ok": true}\')\n')
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setitem(gpu_suite.CHECKS, "boom", ("bench.gpu.no_such_module", [], [], 30))
    monkeypatch.setitem(gpu_suite.CHECKS, "checks", ("fake_check", [], [], 30))
    out = tmp_path / "suite.json"
    monkeypatch.setattr(sys, "argv", ["gpu_suite", "--cpu", "--only", "boom", "checks", "--out", str(out)])
    assert gpu_suite.main() == 1
    rows = {r["name"]: r for r in json.loads(out.read_text())["checks"]}
    assert not rows["boom"]["ok"] and rows["boom"]["rc"] != 0 and "no_such_module" in rows["boom"]["error"]
    assert rows["checks"]["ok"], rows["checks"]  # ran after the failure


def test_a_check_past_its_limit_is_stopped(tmp_path, monkeypatch):
    monkeypatch.setitem(gpu_suite.CHECKS, "slow", ("bench.gpu.checks", ["--cpu"], ["--cpu"], 0.5))
    row = gpu_suite.run_check("slow", cpu=True, tmp=str(tmp_path), scale=1.0)
    assert row["rc"] == 124 and not row["ok"] and "timed out" in row["error"]


@pytest.mark.slow  # 110-260 s: every bench/gpu check end to end; each check's parts have default tests
def test_cpu_smoke_run_passes_every_check(tmp_path):
    out = tmp_path / "suite.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "gpu_suite.py"), "--cpu", "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    summary = json.loads(out.read_text())
    assert [r["name"] for r in summary["checks"]] == list(gpu_suite.CHECKS)
    assert summary["all_ok"], proc.stdout[-3000:]
    assert proc.returncode == 0


def test_the_trainer_check_skips_what_the_gpus_cannot_run_and_says_why():
    """bench/gpu/trainer.py: NCCL needs one GPU per rank. One GPU: W = 1 alone, every
    W > 1 skipped with its reason, and "nothing compared" said; four: up to W = 4; CPU
    (gloo, the smoke run): W = 1 against W = 2, C = 2."""
    from bench.gpu.trainer import plan_meshes

    runs, skipped = plan_meshes(gpu=True, devices=1)
    assert runs == [(1, 1)]
    assert len(skipped) == 5 and all("1 CUDA device(s) here, NCCL needs one GPU per rank" in s for s in skipped[:4])
    assert "nothing compared" in skipped[-1]
    runs, skipped = plan_meshes(gpu=True, devices=4)
    assert runs == [(1, 1), (2, 2), (2, 1), (4, 4)] and skipped == ["W=8 C=8: 4 CUDA device(s) here, NCCL needs one "
                                                                    "GPU per rank"]
    assert plan_meshes(gpu=False, devices=0) == ([(1, 1), (2, 2)], [])


def test_a_check_the_suites_budget_cannot_reach_is_reported_not_run(tmp_path):
    row = gpu_suite.run_check("checks", cpu=True, tmp=str(tmp_path), scale=1.0, left_s=-1.0)
    assert not row["ok"] and row["rc"] is None and "budget" in row["error"]
    assert sum(limit for *_, limit in gpu_suite.CHECKS.values()) > 480  # the budget, not the limits, bounds a call
