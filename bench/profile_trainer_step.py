"""Where a `LongStrawGRPOTrainer` step's time goes, by phase, per rank, in process CPU time.

`bench_distributed.py` times whole steps (wall clock), which on a shared machine says
little. This runs the same trainer (its `worker`: tiny hybrid qwen3_5, G = 4, detached,
chunk 4096, one thread per rank, TRL's string prompts through `token_id_tokenizer`) and
wraps the phases it passes through with timers of both `time.process_time` (this process's
CPU seconds: what the rank computed, whatever else the machine runs) and
`time.perf_counter` (wall). Phases nest; each line is inclusive of the ones indented
below it. Only the steps after the first are counted (the first warms up).

Reading it: at W = 2, C = 2 a rank's CPU seconds per phase against W = 1's say what
divides (capture: about half) and what does not (decode, replay: all of it on every
rank). Wall minus CPU is waiting: on an idle machine, for the peer in a collective.

Usage:
    .venv/bin/python bench/profile_trainer_step.py --world 1 --prompt-tokens 32768
    .venv/bin/python bench/profile_trainer_step.py --world 2 --context 2 --prompt-tokens 32768
    add --cprofile DIR for one process-time cProfile dump per rank (DIR/rank{r}.prof)
Prints one table per rank and ends with one JSON line (rank -> phase -> [cpu_s, wall_s]).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
REPO = os.path.dirname(HERE)

# (label, depth, "module:Class.attribute" or "module:function", patched in the module that calls it)
PHASES = [
    ("trainer step (training_step)", 0, "longstraw.integrations.trl:LongStrawGRPOTrainer.training_step"),
    ("generate + score (TRL)", 1, "trl.trainer.grpo_trainer:GRPOTrainer._generate_and_score_completions"),
    ("tokenise prompts", 2, "trl.trainer.grpo_trainer:GRPOTrainer._tokenize_prompts"),
    ("rollouts (engine.generate)", 2, "longstraw.integrations.trl:LongStrawGRPOTrainer._rollouts"),
    ("generate: agreement + checks", 3, "longstraw.engine.engine:Engine.agree_across_ranks"),
    ("capture", 3, "longstraw.engine.engine:Engine.capture"),
    ("decode (G x R steps)", 3, "longstraw.engine.rollout:run_episodes"),
    ("rewards", 2, "trl.trainer.grpo_trainer:GRPOTrainer._calculate_rewards"),
    ("score (old/ref log-probs)", 2,
     "longstraw.integrations.trl:LongStrawGRPOTrainer._get_per_token_logps_and_entropies"),
    ("micro-batches (Groups)", 2, "longstraw.integrations.trl:LongStrawGRPOTrainer._micro_batches"),
    ("update (engine.step)", 1, "longstraw.engine.engine:Engine.step"),
    ("step: validation", 2, "longstraw.engine.engine:validate"),
    ("replay", 2, "longstraw.engine.engine:replay_tree"),
    ("replicate gradients", 2, "longstraw.engine.engine:replicate_gradients"),
    ("reduce gradients (data)", 1, "longstraw.integrations.trl:reduce_gradients"),
    ("optimizer step", 0, "torch.optim.adamw:AdamW.step"),
]
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "broadcast_object_list", "barrier", "reduce_scatter_tensor")
POINT_TO_POINT = ("isend", "recv")


class Phases:
    """Inclusive (cpu, wall) seconds per phase label; `counting` gates the warm-up step."""

    def __init__(self):
        self.cpu, self.wall, self.calls = defaultdict(float), defaultdict(float), defaultdict(int)
        self.counting = False
        self.active = []  # the phases now running, outermost first
        self.trace = []  # (kind, phase, cpu at entry, cpu at exit, peer): every sync event of the counted steps

    def wrap(self, label, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if label in self.active:  # re-entrant (nested calls of one phase): count the outer one only
                return fn(*args, **kwargs)
            self.active.append(label)
            c0, w0 = time.process_time(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.active.pop()
                if self.counting:
                    self.cpu[label] += time.process_time() - c0
                    self.wall[label] += time.perf_counter() - w0
                    self.calls[label] += 1
        return timed


    def sync(self, kind, fn):
        """`fn`, a torch.distributed call, recorded as a sync event (collectives over groups
        of one rank are not)."""
        import torch.distributed as dist

        @functools.wraps(fn)
        def traced(*args, **kwargs):
            group = kwargs.get("group")
            peer = kwargs.get("dst", kwargs.get("src")) if kind in POINT_TO_POINT else None
            if peer is None and kind in POINT_TO_POINT:
                peer = args[1]
            c0 = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.counting and (kind in POINT_TO_POINT or dist.get_world_size(group) > 1):
                    phase = next((p for p in reversed(self.active) if p != SYNC), "other")
                    self.trace.append((kind, phase, c0, time.process_time(), peer))
        return traced


SYNC = "collectives (torch.distributed)"


def install(phases: Phases) -> None:
    import importlib

    import torch.distributed as dist

    for label, _, where in PHASES:
        module_name, attr = where.split(":")
        module = importlib.import_module(module_name)
        owner, name = (module, attr) if "." not in attr else (getattr(module, attr.split(".")[0]), attr.split(".")[1])
        setattr(owner, name, phases.wrap(label, getattr(owner, name)))
    for name in COLLECTIVES + POINT_TO_POINT:
        setattr(dist, name, phases.wrap(SYNC, phases.sync(name, getattr(dist, name))))


def worker(args) -> None:
    import bench_distributed
    from transformers import TrainerCallback

    import longstraw.integrations.trl as lt

    phases = Phases()
    install(phases)
    rank = int(os.environ.get("RANK", "0"))
    profiler = None
    totals = {"cpu": 0.0, "wall": 0.0, "steps": 0}

    class Gate(TrainerCallback):  # count steps 2.. only, and time each whole optimizer step
        def on_step_begin(self, a, state, control, **kw):
            nonlocal profiler
            phases.counting = state.global_step >= 1
            self.c0, self.w0 = time.process_time(), time.perf_counter()
            if phases.counting:
                phases.trace.append(("begin", "other", self.c0, self.c0, None))
            if phases.counting and args.cprofile and profiler is None:
                import cProfile
                profiler = cProfile.Profile(time.process_time)
                profiler.enable()

        def on_step_end(self, a, state, control, **kw):
            if phases.counting:
                totals["cpu"] += time.process_time() - self.c0
                totals["wall"] += time.perf_counter() - self.w0
                totals["steps"] += 1
                now = time.process_time()
                phases.trace.append(("end", "other", now, now, None))

    init = lt.LongStrawGRPOTrainer.__init__

    def init_with_gate(self, *a, **kw):
        init(self, *a, **kw)
        self.add_callback(Gate())

    lt.LongStrawGRPOTrainer.__init__ = init_with_gate
    c_start = time.process_time()
    bench_distributed.worker(args)
    if profiler is not None:
        profiler.disable()
        os.makedirs(args.cprofile, exist_ok=True)
        profiler.dump_stats(os.path.join(args.cprofile, f"rank{rank}.prof"))
    n = max(totals["steps"], 1)
    row = {"optimizer step (callbacks included)": [totals["cpu"] / n, totals["wall"] / n]}
    for label in [p[0] for p in PHASES] + ["collectives (torch.distributed)"]:
        row[label] = [phases.cpu[label] / n, phases.wall[label] / n]
    row["process total (incl. setup)"] = [time.process_time() - c_start, float("nan")]
    with open(f"{args.result}.rank{rank}", "w") as f:
        json.dump({"phases": row, "trace": phases.trace}, f)


def simulate(traces: list) -> tuple[float, dict]:
    """The counted steps' wall time on an idle machine, predicted from each rank's CPU
    seconds between its sync events: every rank computes at its own pace, a collective
    waits for the last rank to arrive and then costs the least CPU any rank spent in it
    (the others' extra is waiting), a recv waits for its matching isend. Messages are
    taken as instant. Returns (predicted seconds, waiting seconds per phase summed
    over ranks)."""
    world = len(traces)
    kinds = [[e[0] for e in t if e[0] not in POINT_TO_POINT] for t in traces]
    if any(k != kinds[0] for k in kinds):
        raise SystemExit("the ranks' collective sequences differ: cannot align them")
    cost = {}  # k-th collective -> least CPU seconds any rank spent in it
    for r, t in enumerate(traces):
        for k, e in enumerate(e for e in t if e[0] in COLLECTIVES):
            cost[k] = min(cost.get(k, float("inf")), e[3] - e[2])
    at, now, last = [0] * world, [0.0] * world, [None] * world
    ncoll, sends, nrecv = [0] * world, defaultdict(list), defaultdict(int)
    arrived = {}  # rank -> time it reached its pending collective
    waits = defaultdict(float)
    while any(at[r] < len(traces[r]) for r in range(world)):
        moved = False
        for r in range(world):
            while at[r] < len(traces[r]):
                kind, phase, c0, c1, peer = traces[r][at[r]]
                # a counted step's CPU since the last event (between steps: not counted)
                ready = now[r] + (0.0 if last[r] is None or kind == "begin" else c0 - last[r])
                if kind in COLLECTIVES:
                    arrived[r] = ready
                    k = ncoll[r]
                    if not all(ncoll[q] == k and q in arrived for q in range(world)):
                        break  # wait for the others to reach it
                    start = max(arrived.values())
                    for q in range(world):
                        waits[traces[q][at[q]][1]] += start - arrived[q]
                        now[q], last[q] = start + cost[k], traces[q][at[q]][3]
                        ncoll[q] += 1
                        at[q] += 1
                    arrived.clear()
                    moved = True
                    continue
                if kind == "recv":
                    key = (peer, r)
                    if len(sends[key]) <= nrecv[key]:
                        break  # its isend has not happened yet
                    start = max(ready, sends[key][nrecv[key]])
                    waits[phase] += start - ready
                    nrecv[key] += 1
                    now[r] = start + (c1 - c0)
                else:  # begin, end, isend: no waiting
                    now[r] = ready + (c1 - c0)
                    if kind == "isend":
                        sends[(r, peer)].append(now[r])
                last[r] = c1
                at[r] += 1
                moved = True
        if not moved:
            raise SystemExit("the sync events deadlock: cannot align the ranks")
    return max(now), dict(waits)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", default="", help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--context", type=int, default=1)
    ap.add_argument("--prompt-tokens", type=int, default=32768)
    ap.add_argument("--prompts", type=int, default=1, help="prompts per optimizer step")
    ap.add_argument("--response-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps (the first is not counted)")
    ap.add_argument("--cprofile", default="", help="folder for one process-time cProfile dump per rank")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    result = os.path.join(tempfile.mkdtemp(), "phases.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.world),
           __file__, "--worker", "--context", str(args.context), "--prompt-tokens", str(args.prompt_tokens),
           "--prompts", str(args.prompts), "--response-tokens", str(args.response_tokens), "--steps",
           str(args.steps), "--result", result] + (["--cprofile", args.cprofile] if args.cprofile else [])
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    load = os.getloadavg()[0]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stderr[-4000:])
    rows, traces = {}, []
    for r in range(args.world):
        with open(f"{result}.rank{r}") as f:
            got = json.load(f)
        rows[r] = got["phases"]
        traces.append(got["trace"])
    predicted, waits = simulate(traces)
    steps = max(args.steps - 1, 1)
    print(f"W={args.world} C={args.context} P={args.prompt_tokens} R={args.response_tokens} prompts/step="
          f"{args.prompts}; per counted step; load {load:.1f}-{os.getloadavg()[0]:.1f}")
    depth = {label: d for label, d, _ in PHASES}
    header = "".join(f"{f'rank {r} cpu':>11} {'wall':>7}" for r in rows)
    print(f"{'phase':40}{header}")
    for label in rows[0]:
        cells = "".join(f"{rows[r][label][0]:>11.3f} {rows[r][label][1]:>7.2f}" for r in rows)
        print(f"{'  ' * depth.get(label, 0) + label:40}{cells}")
    print(f"predicted idle wall per counted step: {predicted / steps:.3f} s; waiting (all ranks) by phase: "
          + ", ".join(f"{k} {v / steps:.3f} s" for k, v in sorted(waits.items(), key=lambda kv: -kv[1]) if v > 1e-3))
    print(json.dumps({"world": args.world, "context": args.context, "prompt_tokens": args.prompt_tokens,
                      "phases": rows, "predicted_idle_wall_s": predicted / steps,
                      "waiting_s": {k: v / steps for k, v in waits.items()}}))


if __name__ == "__main__":
    main()
