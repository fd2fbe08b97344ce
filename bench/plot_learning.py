"""Plots of the learning experiment from bench/results/learning/<model>-<arm>-s<seed>/log.jsonl.

    python bench/plot_learning.py [--results bench/results/learning [more dirs]] [--out docs]

Writes, per model: learning_<model>_reward.png (training reward against step, a moving
average of 5 steps; the band is the min..max over seeds when there are several) and
learning_<model>_heldout.png (held-out accuracy, greedy, at the training P, against step;
step 0 is the warm start). Lines are the mean over seeds on the steps every seed ran; a
seed that ran longer continues as its own dashed line. Also learning_<model>_exact_vs_full.png when both exact and
full ran: their per-step training reward, and the relative gap of their gradient norms.
Prints a table of before/after accuracy and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from collections import defaultdict

COLORS = {"exact": "tab:blue", "detached": "tab:orange", "full": "tab:green", "tree": "tab:red"}
LABELS = {"exact": "LongStraw exact", "detached": "LongStraw detached", "full": "full-sequence HF",
          "tree": "tree rollouts (detached)"}


def load(results: list[str]) -> dict:
    runs = defaultdict(dict)  # (model, arm) -> seed -> records
    for path in sorted(p for r in results for p in glob.glob(os.path.join(r, "*-*-s*", "log.jsonl"))):
        model, arm, seed = os.path.basename(os.path.dirname(path)).rsplit("-", 2)
        with open(path) as f:
            runs[(model, arm)][int(seed[1:])] = [json.loads(line) for line in f]
    return runs


def smooth(xs, k=5):
    out = []
    for i in range(len(xs)):
        w = xs[max(0, i - k + 1) : i + 1]
        out.append(sum(w) / len(w))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", nargs="+", default=["bench/results/learning"], help="one or more results dirs")
    ap.add_argument("--out", default="docs")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = load(args.results)
    summary = []
    for model in sorted({m for m, _ in runs}):
        arms = [a for a in ("exact", "detached", "full", "tree") if (model, a) in runs]
        fig_r, ax_r = plt.subplots(figsize=(6.4, 4))
        fig_h, ax_h = plt.subplots(figsize=(6.4, 4))
        for arm in arms:
            seeds = runs[(model, arm)]
            curves, evals = [], []
            for seed, log in sorted(seeds.items()):
                steps = [r for r in log if "reward_mean" in r]
                curves.append(([r["step"] for r in steps], smooth([r["reward_mean"] for r in steps])))
                ev = [(r["step"], r["heldout_accuracy"]) for r in log if "heldout_accuracy" in r]
                evals.append(ev)
                cpu = sum(r.get("time_step_s", 0.0) for r in log) + sum(r.get("time_eval_s", 0.0) for r in log
                                                                         if r.get("phase") == "warm_start")
                summary.append({"model": model, "arm": arm, "seed": seed, "steps": ev[-1][0],
                                "heldout_before": ev[0][1], "heldout_after": ev[-1][1],
                                "train_reward_first10": sum(r["reward_mean"] for r in steps[:10]) / max(1, len(steps[:10])),
                                "train_reward_last10": sum(r["reward_mean"] for r in steps[-10:]) / max(1, len(steps[-10:])),
                                "wall_s": cpu})
            n = min(len(c[0]) for c in curves)
            xs = curves[0][0][:n]
            ys = [sum(c[1][i] for c in curves) / len(curves) for i in range(n)]
            label = f"{LABELS[arm]} ({len(curves)} seed{'s' if len(curves) > 1 else ''})"
            ax_r.plot(xs, ys, color=COLORS[arm], label=label)
            if len(curves) > 1:
                ax_r.fill_between(xs, [min(c[1][i] for c in curves) for i in range(n)],
                                  [max(c[1][i] for c in curves) for i in range(n)], color=COLORS[arm], alpha=0.15)
            m = min(len(e) for e in evals)
            ex = [evals[0][i][0] for i in range(m)]
            ey = [sum(e[i][1] for e in evals) / len(evals) for i in range(m)]
            ax_h.plot(ex, ey, "o-", color=COLORS[arm], label=label)
            if len(evals) > 1:
                ax_h.fill_between(ex, [min(e[i][1] for e in evals) for i in range(m)],
                                  [max(e[i][1] for e in evals) for i in range(m)], color=COLORS[arm], alpha=0.15)
            # a seed that ran longer than the others: its own continuation, dashed (not averaged)
            for c in curves:
                if len(c[0]) > n:
                    ax_r.plot(c[0][n - 1:], c[1][n - 1:], "--", color=COLORS[arm], alpha=0.7)
            for e in evals:
                if len(e) > m:
                    ax_h.plot([x for x, _ in e[m - 1:]], [y for _, y in e[m - 1:]], "o--", color=COLORS[arm], alpha=0.7)
        P = next(iter(runs[(model, arms[0])].values()))[-1].get("prompt_tokens")
        ax_r.set(xlabel="GRPO step", ylabel="training reward (moving average, 5 steps)", ylim=(0, 1.02),
                 title=f"tiny {model} model, P = {P:,}: training reward")
        ax_h.set(xlabel="GRPO step (0 = warm start)", ylabel="held-out accuracy (greedy)", ylim=(0, 1.02),
                 title=f"tiny {model} model, P = {P:,}: held-out accuracy")
        for fig, ax, name in ((fig_r, ax_r, "reward"), (fig_h, ax_h, "heldout")):
            ax.grid(alpha=0.3)
            ax.legend(loc="lower right")
            fig.tight_layout()
            fig.savefig(os.path.join(args.out, f"learning_{model}_{name}.png"), dpi=110)
        plt.close("all")
        if (model, "exact") in runs and (model, "full") in runs:
            fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
            common = sorted(set(runs[(model, "exact")]) & set(runs[(model, "full")]))
            for seed in common:
                e = {r["step"]: r for r in runs[(model, "exact")][seed] if "reward_mean" in r}
                f = {r["step"]: r for r in runs[(model, "full")][seed] if "reward_mean" in r}
                steps = sorted(set(e) & set(f))
                a1.plot(steps, [e[s]["reward_mean"] for s in steps], "o-", color=COLORS["exact"], ms=3,
                        label=f"exact, seed {seed}")
                a1.plot(steps, [f[s]["reward_mean"] for s in steps], "x--", color=COLORS["full"], ms=5,
                        label=f"full-sequence, seed {seed}")
                a2.semilogy(steps, [abs(e[s]["grad_norm"] - f[s]["grad_norm"]) / max(e[s]["grad_norm"], 1e-30) + 1e-20
                                    for s in steps], "o-", ms=3, label=f"seed {seed}")
                summary.append({"model": model, "exact_vs_full_seed": seed, "steps_compared": len(steps),
                                "max_abs_reward_diff": max(abs(e[s]["reward_mean"] - f[s]["reward_mean"]) for s in steps),
                                "max_abs_loss_diff": max(abs(e[s]["loss"] - f[s]["loss"]) for s in steps),
                                "max_rel_grad_norm_diff": max(abs(e[s]["grad_norm"] - f[s]["grad_norm"])
                                                              / max(e[s]["grad_norm"], 1e-30) for s in steps)})
            a1.set(xlabel="GRPO step", ylabel="training reward (per step)", title="exact vs full-sequence: reward")
            a2.set(xlabel="GRPO step", ylabel="|gn_exact - gn_full| / gn_exact",
                   title="pre-clip gradient norm, relative difference (float32)")
            for a in (a1, a2):
                a.grid(alpha=0.3)
                a.legend(fontsize=8)
            fig.tight_layout()
            fig.savefig(os.path.join(args.out, f"learning_{model}_exact_vs_full.png"), dpi=110)
            plt.close(fig)
    for row in summary:
        if "arm" in row:
            print(f"{row['model']:>7} {row['arm']:>9} seed {row['seed']}: held-out {row['heldout_before']:.3f} -> "
                  f"{row['heldout_after']:.3f} after {row['steps']} steps; training reward first 10 "
                  f"{row['train_reward_first10']:.3f}, last 10 {row['train_reward_last10']:.3f}")
        else:
            print(f"{row['model']:>7} exact vs full, seed {row['exact_vs_full_seed']}: {row['steps_compared']} steps, "
                  f"max |reward diff| {row['max_abs_reward_diff']:.2e}, max |loss diff| {row['max_abs_loss_diff']:.2e}, "
                  f"max relative grad-norm diff {row['max_rel_grad_norm_diff']:.2e}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
