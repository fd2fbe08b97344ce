"""Plots of the peer comparison (bench/bench_step.py rows): peak memory vs P, step time
vs P, peak memory vs G, one line per method, one panel per model family.

    .venv/bin/python bench/plot_results.py bench/results/peers_sweep.csv bench/results/peers_exact256.csv \
        --out-dir docs

Reads every row with status "ok" (repeats: median peak, fastest time); exact-mode rows
with a chunk other than 1024 get their own line. Writes
peak_vs_p.png, time_vs_p.png and peak_vs_g.png. The sweep along P uses --g (default 4),
the sweep along G uses --p (default 4096).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

METHOD_STYLE = {
    "detached": ("LongStraw detached", "tab:blue", "o"),
    "exact": ("LongStraw exact (chunk 1024)", "tab:green", "s"),
    "exact@256": ("LongStraw exact (chunk 256)", "tab:olive", "P"),
    "naive": ("HF naive (G sequential)", "tab:red", "v"),
    "batched": ("HF batched (TRL)", "tab:orange", "^"),
    "prefix_grouper": ("Prefix Grouper", "tab:purple", "D"),
}
FAMILY_TITLE = {"qwen3": "tiny Qwen3 (dense)", "qwen3_5": "tiny Qwen3.5/3.6 (hybrid GDN + attention)"}
MIB = 2**20


def load(paths):
    rows = []
    for path in paths:
        with open(path, newline="") as f:
            rows += [r for r in csv.DictReader(f) if r["status"] == "ok"]
    agg = {}
    for r in rows:
        method = r["method"]
        if method == "exact" and r.get("chunk_size") not in (None, "", "1024"):
            method = f"exact@{r['chunk_size']}"  # exact mode with another chunk: its own line
        key = (r["family"], method, int(r["P"]), int(r["G"]))
        peak, t = float(r["peak_above_model"]), float(r["step_time_s"])
        agg.setdefault(key, ([], []))
        agg[key][0].append(peak)
        agg[key][1].append(t)
    return {k: (statistics.median(v[0]), min(v[1])) for k, v in agg.items()}


def panel_plot(data, families, axis, fixed, metric, ylabel, path, logx):
    fig, axes = plt.subplots(1, len(families), figsize=(6 * len(families), 4.4), squeeze=False)
    for ax, fam in zip(axes[0], families):
        for method, (label, color, marker) in METHOD_STYLE.items():
            pts = sorted((k[2] if axis == "P" else k[3], v[metric]) for k, v in data.items()
                         if k[0] == fam and k[1] == method and (k[3] if axis == "P" else k[2]) == fixed)
            if not pts:
                continue
            xs, ys = zip(*pts)
            ys = [y / MIB for y in ys] if metric == 0 else ys
            ax.plot(xs, ys, marker=marker, color=color, label=label)
        ax.set_title(FAMILY_TITLE.get(fam, fam) + (f", G = {fixed}" if axis == "P" else f", P = {fixed:,}"))
        ax.set_xlabel("prompt tokens P" if axis == "P" else "group size G")
        ax.set_ylabel(ylabel)
        if logx:
            ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("one GRPO step, CPU (2 threads), float32, R = 128; fresh process per point", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print("wrote", path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("csv", nargs="+")
    p.add_argument("--out-dir", default="docs")
    p.add_argument("--g", type=int, default=4, help="G of the sweep along P")
    p.add_argument("--p", type=int, default=4096, help="P of the sweep along G")
    args = p.parse_args(argv)
    data = load(args.csv)
    families = [f for f in ("qwen3", "qwen3_5") if any(k[0] == f for k in data)]
    os.makedirs(args.out_dir, exist_ok=True)
    panel_plot(data, families, "P", args.g, 0, "peak RSS above loaded model (MiB)",
               os.path.join(args.out_dir, "peak_vs_p.png"), logx=True)
    panel_plot(data, families, "P", args.g, 1, "step time (s)", os.path.join(args.out_dir, "time_vs_p.png"), logx=True)
    panel_plot(data, families, "G", args.p, 0, "peak RSS above loaded model (MiB)",
               os.path.join(args.out_dir, "peak_vs_g.png"), logx=True)


if __name__ == "__main__":
    main()
