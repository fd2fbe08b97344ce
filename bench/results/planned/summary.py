"""One line per planned run in this folder: peak per rank, its share of the GPU, the phase
that sets it, and whether it fits. python bench/results/planned/summary.py"""
import glob
import json
import os

for f in sorted(glob.glob(os.path.join(os.path.dirname(__file__), "*.json"))):
    r, G = json.load(open(f)), 2**30
    if not isinstance(r, dict) or "breakdown" not in r:  # scale.json (bench/plan_scale.py): a list of fits
        continue
    phases = {k: round(v / G, 1) for k, v in r["breakdown"]["phase_peak_bytes"].items()}
    print(f"{os.path.basename(f):42} {r['mode']:8} peak {r['peak_bytes_per_rank'] / G:6.1f} GiB "
          f"({100 * r['peak_bytes_per_rank'] / r['gpu_memory_bytes']:3.0f}% of {r['gpu_memory_bytes'] / G:.0f} GiB) "
          f"{r['peak_phase']:9} fits={r['fits']} recompute={r['replay_recompute_layers']} "
          f"divided_capture={r['divided_capture']} {phases}")
