"""`longstraw plan --sweep gpus=8,16,...,1024 [--fit] [--plot FILE.png]`: one plan (or one fit)
per value of a PlanConfig field, and what a user sizing a run reads off them: the step's
time, the memory per rank, and the share of the time that is communication, against GPUs
(or against P at a fixed GPU count: `--sweep prompt_tokens=1048576,2097152,...`).
Torch-free; the plot needs matplotlib (imported only to draw).
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import ConfigError
from .config import PlanConfig
from .estimate import estimate
from .fit import Fit, flags, search

SWEEPABLE = {"gpus": int, "prompt_tokens": int, "group": int, "response_tokens": int, "data_parallel": int}


def parse_sweep(text: str) -> tuple[str, list]:
    """"gpus=8,16,32" -> ("gpus", [8, 16, 32])."""
    name, _, values = str(text).partition("=")
    name = name.strip().replace("-", "_")
    if name not in SWEEPABLE or not values:
        raise ConfigError(f"--sweep must be FIELD=V1,V2,... with FIELD one of {', '.join(SWEEPABLE)}, got {text!r}")
    try:
        return name, [SWEEPABLE[name](v) for v in values.split(",") if v.strip()]
    except ValueError as exc:
        raise ConfigError(f"--sweep {text!r}: values must be integers") from exc


def sweep(model, base: PlanConfig, name: str, values: list, *, fit: bool = False, pinned=()) -> list[dict]:
    """One row per value: the plan (or `--fit`'s choice) with `name` set to it."""
    rows = []
    for v in values:
        c = replace(base, **{name: v})
        row = {name: v}
        if fit:
            res = search(model, c, pinned)
            if not isinstance(res, Fit):
                rows.append({**row, "fits": False, "binding": res.binding})
                continue
            c, r = res.config, res.report
            row["flags"] = flags(c)
        else:
            r = estimate(model, c)
        total = r["estimated_time_s"]
        rows.append({**row, "fits": bool(r["fits"]), "peak_bytes_per_rank": int(r["peak_bytes_per_rank"]),
                     "time_s": total, "comm_s": r["comm"]["comm_s"],
                     "comm_share": r["comm"]["exposed_s"] / total if total else 0.0,
                     "gpu_hours": total * c.gpus * c.data_parallel / 3600})
    return rows


def format_sweep(name: str, rows: list[dict]) -> str:
    """A table of the sweep."""
    lines = [f"  {name:>14s}  {'peak/rank GiB':>13s}  {'time s':>11s}  {'comm %':>6s}  {'GPU-h':>9s}  fits"]
    for r in rows:
        if "time_s" not in r:
            lines.append(f"  {r[name]:>14,}  {'-':>13s}  {'-':>11s}  {'-':>6s}  {'-':>9s}  no: {r['binding']}")
            continue
        lines.append(f"  {r[name]:>14,}  {r['peak_bytes_per_rank'] / 2**30:>13.1f}  {r['time_s']:>11,.0f}  "
                     f"{100 * r['comm_share']:>6.1f}  {r['gpu_hours']:>9,.1f}  {'yes' if r['fits'] else 'NO'}"
                     + (f"  {' '.join(r['flags'])}" if r.get("flags") else ""))
    return "\n".join(lines)


def plot_sweep(name: str, rows: list[dict], path: str, title: str = "") -> None:
    """Time, memory per rank and communication share against the swept field (log x), to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "time_s" in r]
    if not ok:
        raise ConfigError("--plot: no value of the sweep fits; nothing to draw")
    x = [r[name] for r in ok]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, label, scale in ((axes[0], "time_s", "step time (s)", 1.0),
                                  (axes[1], "peak_bytes_per_rank", "peak per rank (GiB)", 2**-30),
                                  (axes[2], "comm_share", "communication not hidden (% of the time)", 100.0)):
        ax.plot(x, [r[key] * scale for r in ok], marker="o")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(name)
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
