"""Markdown tables (for docs/results.md) from the CSVs bench/bench_step.py wrote to
bench/results/. Repeats of one (family, method, P, G, chunk) are aggregated: median peak,
fastest time (phase times from that fastest run).

    .venv/bin/python bench/summarize.py            # every table, to stdout
    .venv/bin/python bench/summarize.py exact      # one section
"""

from __future__ import annotations

import csv
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RES = os.path.join(REPO, "bench", "results")
MIB = 2**20


def load(name):
    path = os.path.join(RES, name)
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def f(r, k):
    try:
        return float(r[k])
    except (KeyError, TypeError, ValueError):
        return None


def agg(rows, key=("family", "method", "P", "G", "chunk_size")):
    """{key: aggregated row} over status == ok rows; other statuses kept as is."""
    groups = {}
    for r in rows:
        groups.setdefault(tuple(r.get(k) for k in key), []).append(r)
    out = {}
    for k, rs in groups.items():
        ok = [r for r in rs if r["status"] == "ok"]
        if not ok:
            out[k] = dict(rs[-1], n=0)
            continue
        best = dict(min(ok, key=lambda r: f(r, "step_time_s")))
        best["peak"] = statistics.median(f(r, "peak_above_model") for r in ok)
        best["peaks"] = [f(r, "peak_above_model") for r in ok]
        lives = [f(r, "live_tensor_peak") for r in ok if f(r, "live_tensor_peak")]
        best["live"] = statistics.median(lives) if lives else None
        best["time"] = f(best, "step_time_s")
        best["times"] = [f(r, "step_time_s") for r in ok]
        best["n"] = len(ok)
        out[k] = best
    return out


def mib(v, nd=1):
    return "–" if v is None else f"{v / MIB:,.{nd}f}"


def sec(v, nd=2):
    return "–" if v is None else f"{v:,.{nd}f}"


def table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def verdict(ok):
    return "**pass**" if ok else "**MISS**"


# ---------------------------------------------------------------------------


def capture():
    cap = agg(load("hybrid_capture_vs_hf.csv"), key=("method",))
    det = agg(load("hybrid_64k_detached.csv"), key=("G",))
    out = ["### Hybrid capture vs HF forward, P = 65,536", ""]
    c, h = cap.get(("capture",)), cap.get(("hf_forward",))
    if c and h and c["n"] and h["n"]:
        rows = [[m, r["n"], " / ".join(sec(t) for t in r["times"]), sec(r["time"]), mib(r["peak"]),
                 mib(f(r, "state_bytes")) if m == "capture" else "–"] for m, r in (("capture", c), ("hf_forward", h))]
        out.append(table(["method", "runs", "times (s)", "min time (s)", "peak above model (MiB, median)",
                          "state (MiB)"], rows))
        ratio = c["time"] / h["time"]
        out += ["", f"capture / hf_forward time (min of 2 each): **{ratio:.2f}x** (target <= 1.5x: "
                    f"{verdict(ratio <= 1.5)}); peak: {c['peak'] / h['peak']:.2f}x", ""]
    rows = []
    for (g,), r in sorted(det.items(), key=lambda kv: int(kv[0][0])):
        rows.append([g, mib(r["peak"]), mib(f(r, "state_bytes")), sec(r["time"]), sec(f(r, "time_capture_s")),
                     sec(f(r, "time_replay_s"))])
    if rows:
        out.append(table(["G", "peak above model (MiB)", "state (MiB)", "step (s)", "capture (s)", "replay (s)"],
                         rows))
        gs = sorted(det, key=lambda k: int(k[0]))
        if len(gs) >= 2:
            lo, hi = det[gs[0]], det[gs[-1]]
            out += ["", f"detached peak G={gs[-1][0]} / G={gs[0][0]}: **{hi['peak'] / lo['peak']:.3f}**"]
    return "\n".join(out)


# re-measured after the in-place attention kernel (the first runs: hybrid_8k_modes_before_inplace.csv, hybrid_exact_chunk_before_inplace.csv)
EXACT_MAIN, EXACT_CHUNK = "hybrid_8k_modes.csv", "hybrid_exact_chunk.csv"


def exact():
    main = agg(load(EXACT_MAIN))
    out = ["### Exact mode: hybrid, P = 8,192, R = 128 (exact: chunk 1024)", ""]
    rows = []
    for g in ("2", "8"):
        for m in ("detached", "exact", "naive"):
            r = next((v for k, v in main.items() if k[1] == m and k[3] == g), None)
            if r is None:
                continue
            rows.append([m, g, r["n"], mib(r["peak"]), " / ".join(mib(p, 0) for p in r["peaks"]), mib(r["live"]),
                         sec(r["time"]), sec(f(r, "time_capture_s")), sec(f(r, "time_replay_s")),
                         sec(f(r, "time_reverse_s")), r.get("chunk_size") or "–"])
    out.append(table(["method", "G", "runs", "peak above model (MiB, median)", "all runs", "live tensors (MiB)",
                      "step (s, min)", "capture", "replay", "reverse", "chunk"], rows))

    def get(m, g, src=main, chunk=None):
        return next((v for k, v in src.items() if k[1] == m and k[3] == g and (chunk is None or k[4] == chunk)
                     and v["n"]), None)

    out += ["", "| ratio | G = 2 | G = 8 | target |", "|---|---|---|---|"]
    for name, fn, target, le in (
            ("exact / detached peak (RSS)", lambda g: get("exact", g)["peak"] / get("detached", g)["peak"], 3, True),
            ("exact / detached peak (live tensors)",
             lambda g: get("exact", g)["live"] / get("detached", g)["live"], 3, True),
            ("exact / naive peak (RSS)", lambda g: get("exact", g)["peak"] / get("naive", g)["peak"], 1 / 3, True),
            ("exact / naive peak (live tensors)",
             lambda g: get("exact", g)["live"] / get("naive", g)["live"], 1 / 3, True),
            ("exact / detached step time", lambda g: get("exact", g)["time"] / get("detached", g)["time"], 3.5,
             True)):
        try:
            vals = [fn(g) for g in ("2", "8")]
        except (TypeError, KeyError):
            continue
        out.append(f"| {name} | {vals[0]:.2f} ({verdict(vals[0] <= target)}) | {vals[1]:.2f} "
                   f"({verdict(vals[1] <= target)}) | <= {target:.3g} |")
    try:
        e2, e8 = get("exact", "2"), get("exact", "8")
        v, vl = e8["peak"] / e2["peak"], e8["live"] / e2["live"]
        out.append(f"| exact peak G=8 / G=2 | {v:.3f} RSS, {vl:.3f} live ({verdict(v <= 1.05)}) | | <= 1.05 |")
    except (TypeError, KeyError):
        pass

    ch = agg(load(EXACT_CHUNK) + [r for r in load(EXACT_MAIN) if r["method"] == "exact"])
    det = {k[3]: v for k, v in main.items() if k[1] == "detached" and v["n"]}
    rows = []
    for k, r in sorted(ch.items(), key=lambda kv: (int(kv[0][3]), int(kv[0][4] or 0))):
        if not r["n"]:
            continue
        d = det.get(k[3])
        rows.append([k[4], k[3], r["n"], mib(r["peak"]), mib(r["live"]), sec(r["time"]),
                     sec(f(r, "time_capture_s")), sec(f(r, "time_replay_s")), sec(f(r, "time_reverse_s")),
                     f"{r['peak'] / d['peak']:.2f}" if d else "–", f"{r['live'] / d['live']:.2f}" if d else "–",
                     f"{r['time'] / d['time']:.2f}" if d else "–"])
    out += ["", "Exact mode's chunk (`--exact-chunk-size`, i.e. `ExecConfig(chunk_size=...)` in exact mode), "
                "P = 8,192:", "",
            table(["exact chunk", "G", "runs", "peak above model (MiB)", "live tensors (MiB)", "step (s)",
                   "capture", "replay", "reverse", "x detached peak", "x detached live", "x detached time"], rows)]
    return "\n".join(out)


def dsa():
    rows_all = load("glm_dsa_sweep.csv")
    a = agg(rows_all)
    out = ["### GLM-5-shaped MLA + DSA (tiny, index_topk 256), G = 2, R = 128", ""]
    rows = []
    for k, r in sorted(a.items(), key=lambda kv: (kv[0][1] != "detached", int(kv[0][2]))):
        if not r["n"]:
            continue
        P = int(k[2])
        rep = f(r, "time_replay_s")
        idx, fwd, bwd = (f(r, "dsa_replay_indexer_topk_s"), f(r, "dsa_replay_sparse_attn_fwd_s"),
                         f(r, "dsa_replay_sparse_attn_bwd_s"))
        rowsel = f(r, "dsa_replay_topk_rows_selected")
        nq = f(r, "dsa_replay_topk_queries")
        rows.append([k[1], f"{P:,}", r["n"], mib(r["peak"]), mib(f(r, "state_bytes")), sec(r["time"]),
                     sec(f(r, "time_capture_s")), sec(rep, 3), sec(f(r, "time_reverse_s")),
                     sec(idx, 3), sec(None if fwd is None else fwd + bwd, 3),
                     sec(None if idx is None else rep - idx - fwd - bwd, 3),
                     "–" if not nq else f"{rowsel / nq:.0f} of {P:,}"])
    out.append(table(["method", "P", "runs", "peak above model (MiB)", "state (MiB)", "step (s)", "capture (s)",
                      "replay (s)", "reverse (s)", "replay: indexer top-k (s)", "replay: sparse attn fwd+bwd (s)",
                      "replay: rest (s)", "rows attended per replayed query"], rows))
    det = {int(k[2]): v for k, v in a.items() if k[1] == "detached" and v["n"]}
    if len(det) >= 2:
        ps = sorted(det)
        lo, hi = det[ps[0]], det[ps[-1]]
        ratio_p = ps[-1] / ps[0]

        def noidx(r):
            return f(r, "time_replay_s") - f(r, "dsa_replay_indexer_topk_s")
        out += ["", f"From P = {ps[0]:,} to {ps[-1]:,} ({ratio_p:.0f}x): replay time x"
                    f"{f(hi, 'time_replay_s') / f(lo, 'time_replay_s'):.2f}; without the indexer scoring x"
                    f"{noidx(hi) / noidx(lo):.2f}; the indexer scoring alone x"
                    f"{f(hi, 'dsa_replay_indexer_topk_s') / f(lo, 'dsa_replay_indexer_topk_s'):.2f}; "
                    f"sparse attention fwd+bwd x"
                    f"{(f(hi, 'dsa_replay_sparse_attn_fwd_s') + f(hi, 'dsa_replay_sparse_attn_bwd_s')) / (f(lo, 'dsa_replay_sparse_attn_fwd_s') + f(lo, 'dsa_replay_sparse_attn_bwd_s')):.2f}."]
        if 8192 in det and 32768 in det:
            lo, hi = det[8192], det[32768]
            out += [f"From P = 8,192 to 32,768 (4x): replay time x"
                    f"{f(hi, 'time_replay_s') / f(lo, 'time_replay_s'):.2f}; without the indexer scoring x"
                    f"{noidx(hi) / noidx(lo):.2f}; the indexer scoring alone x"
                    f"{f(hi, 'dsa_replay_indexer_topk_s') / f(lo, 'dsa_replay_indexer_topk_s'):.2f}."]
    return "\n".join(out)


def peers():
    rows = load("peers_sweep.csv")
    for r in load("peers_exact256.csv"):
        rows.append(dict(r, method=f"exact@{r['chunk_size'] or 256}"))
    a = agg(rows, key=("family", "method", "P", "G"))
    methods = ("detached", "exact", "exact@256", "naive", "batched", "prefix_grouper")
    out = ["### Peer comparison, R = 128", ""]
    for fam in ("qwen3", "qwen3_5"):
        for axis, fixed, xs in (("P", "4", ("1024", "2048", "4096", "8192")), ("G", "4096", ("2", "4", "8"))):
            present = [m for m in methods if any(k[0] == fam and k[1] == m for k in a)]
            if not present:
                continue
            title = (f"**{fam}**, G = 4, along P" if axis == "P" else f"**{fam}**, P = 4,096, along G")
            hdr = [axis] + present
            body_p, body_t = [], []
            for x in xs:
                key = lambda m: (fam, m, x, fixed) if axis == "P" else (fam, m, fixed, x)  # noqa: E731
                d = a.get(key("detached"))
                cells_p, cells_t = [], []
                for m in present:
                    r = a.get(key(m))
                    if r is None:
                        cells_p.append("–")
                        cells_t.append("–")
                    elif not r["n"]:
                        cells_p.append(r["status"].split(":")[0])
                        cells_t.append(r["status"].split(":")[0])
                    else:
                        xp = f" ({r['peak'] / d['peak']:.1f}x)" if d and d["n"] and m != "detached" else ""
                        xt = f" ({r['time'] / d['time']:.1f}x)" if d and d["n"] and m != "detached" else ""
                        cells_p.append(f"{r['peak'] / MIB:,.0f}{xp}")
                        cells_t.append(f"{r['time']:,.2f}{xt}")
                body_p.append([f"{int(x):,}"] + cells_p)
                body_t.append([f"{int(x):,}"] + cells_t)
            out += [f"{title}: peak RSS above model, MiB (x detached)", "", table(hdr, body_p), "",
                    f"{title}: step time, s (x detached)", "", table(hdr, body_t), ""]
    notes = {(r["method"], r["family"], r["note"]) for r in rows if r["status"] not in ("ok",) and r.get("note")}
    out += [f"- {m} on {fam}: {note}" for m, fam, note in sorted(notes)]
    return "\n".join(out)


SECTIONS = {"capture": capture, "exact": exact, "dsa": dsa, "peers": peers}

if __name__ == "__main__":
    for name in sys.argv[1:] or SECTIONS:
        print(SECTIONS[name]())
        print()
