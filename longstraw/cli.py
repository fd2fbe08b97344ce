"""The `longstraw` command. Thin: it parses flags and calls the library.

    longstraw demo [--prompt-tokens 32768] [--group 8] [--response-tokens 256] [--lr 1e-5]
                   [--chunk-size 4096] [--mode detached] [--family qwen3] [--dtype float32]
    longstraw plan --model PRESET_OR_CONFIG_JSON --prompt-tokens N --group G --response-tokens R
                   [--mode detached|exact] [--gpus W] [--gpu-memory 96GiB] [--dtype bf16]
                   [--lora-rank r] [--chunk-size 4096] [--throughput-tflops 400] [--json] ...
    longstraw grpo --model_name_or_path DIR --dataset_name FILE.jsonl --reward_funcs file.py:func
                   [--config FILE.yaml] [TRL's GRPO script flags] [--longstraw_* ...]   (grpo_cli.py)
    longstraw export CHECKPOINT OUT [--model tiny:qwen3|HF_FOLDER] [--tokenizer DIR] [--merge]   (export.py)
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import os
import sys

from longstraw import defaults
from longstraw import fit_advice, quiet
from longstraw.errors import ConfigError, DoesNotFitError, LongStrawError
from longstraw.plan import PlanConfig, estimate, format_report

# `longstraw plan` runs without torch (the planner needs none): the commands that load a
# model import torch and the engine when they run, the one place in the package where
# function-level imports of its own modules stand (tests/test_architecture.py allows it).


def _init_torchrun():
    from longstraw.parallel.launch import init_distributed

    """Under torchrun (WORLD_SIZE > 1): init the default process group
    (`parallel.launch.init_distributed`: restartable under --max-restarts, collectives
    time out after LONGSTRAW_COLLECTIVE_TIMEOUT); return (rank, device): NCCL on
    cuda:LOCAL_RANK where CUDA is available, else gloo on CPU. (None, cpu) without torchrun."""
    return init_distributed()


def demo(args) -> int:
    """`longstraw demo` (longstraw/demo.py): one GRPO iteration on a tiny built-in model."""
    from longstraw.demo import demo as run_demo

    return run_demo(args)


def _positive_int(value: str) -> int:
    """An int >= 1 (`--rehearse-workers`)."""
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value!r}")
    return n


def _auto_on_off(value: str):
    """`--recompute-layers`: auto -> None, on -> True, off -> False."""
    choices = {"auto": None, "on": True, "off": False}
    if value not in choices:
        raise argparse.ArgumentTypeError(f"expected one of auto, on, off, got {value!r}")
    return choices[value]


_PLAN_FIELDS = ("prompt_tokens", "group", "response_tokens", "mode", "gpus", "gpu_memory", "reserve", "dtype",
                "weight_dtype", "lora_rank", "lora_targets", "chunk_size", "branch_chunk_size", "attention_block_size",
                "logits_chunk_size", "self_attention", "gdn_kernel", "grads_during_capture", "shard_params",
                "expert_parallel", "offload_state", "host_bandwidth_gbs", "score_passes", "keep_graph_bytes",
                "keep_attention_outputs", "throughput_tflops", "recompute_layers", "divide_capture", "divide_walk", "tree", "share_response_prefixes", "offload_snapshots",
                "gpu", "gpus_per_node", "intra_node_gbs", "inter_node_gbs", "data_parallel", "images", "image_tokens", "generate",
                "shard_block_size")


_SEARCHED_FLAGS = {"mode": "--mode", "branch_chunk_size": "--branch-chunk-size", "chunk_size": "--chunk-size",
                   "recompute_layers": "--recompute-layers", "offload_state": "--offload-state",
                   "offload_snapshots": "--offload-snapshots", "expert_parallel": "--expert-parallel",
                   "shard_params": "--shard-params", "keep_graph_bytes": "--keep-graph-bytes",
                   "divide_capture": "--replicate-capture", "divide_walk": "--replicate-walk",
                   "share_response_prefixes": "--flat-responses"}
"""The flags of the fields `--fit` searches: one given on the command line pins its field."""


def _pinned(argv) -> set:
    """The searched fields whose flag is on the command line (`--flag value` or `--flag=value`)."""
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    # kept attention outputs: measured on CPU only so far, so the GPU planner does not search
    # them (`fit_config` does on CPU)
    return {name for name, flag in _SEARCHED_FLAGS.items() if flag in given} | {"keep_attention_outputs"}


def _sweep(args, config, argv) -> int:
    """`longstraw plan --sweep FIELD=V1,V2,...` (with --fit, --plot, --json)."""
    from longstraw.plan.sweep import format_sweep, parse_sweep, plot_sweep, sweep

    name, values = parse_sweep(args.sweep)
    rows = sweep(args.model, config, name, values, fit=args.fit, pinned=_pinned(argv))
    if args.plot:
        plot_sweep(name, rows, args.plot, title=f"{args.model}, P={config.prompt_tokens:,}, G={config.group}, "
                                                f"R={config.response_tokens:,}, {config.mode}"
                                                + (f", {config.gpu}" if config.gpu else ""))
    print(json.dumps({"sweep": name, "rows": rows}) if args.json else format_sweep(name, rows))
    return 0


def plan(args, argv=()) -> int:
    if args.tree is None and (args.group is None or args.response_tokens is None):
        raise ConfigError("longstraw plan: give --group and --response-tokens, or --tree (e.g. --tree 2048x1,256x8)")
    config = PlanConfig(**{name: getattr(args, name) for name in _PLAN_FIELDS})
    if args.sweep:
        return _sweep(args, config, argv)
    if not args.fit:
        if args.rehearse:
            from longstraw.rehearsal.against_plan import refuse_unrehearsed
            refuse_unrehearsed(config)  # before any work
        report = estimate(args.model, config)
        text = format_report(report)
        if args.rehearse:
            text += "\n\n" + _rehearse(args.model, config, report, args)
        print(json.dumps(report) if args.json else text)
        return 0
    from longstraw.plan.fit import fit_report, format_fit, search

    result = search(args.model, config, _pinned(argv))
    entry = fit_report(result)
    report = estimate(args.model, result.config) if entry["fit"] else result.leanest
    report.update(entry)
    text = format_report(report) + "\n\n" + format_fit(result)
    fits = entry["fit"]
    if args.rehearse and fits:  # the chosen configuration, rehearsed: a choice whose rehearsal does not fit fails
        text += "\n\n" + _rehearse(args.model, result.config, report, args)
        fits = report["rehearsal"]["fits"]
    print(json.dumps(report) if args.json else text)
    return 0 if fits else 3


PARALLEL_REHEARSAL_FROM = 1 << 18
"""`--rehearse-workers`' default: the machine's CPUs from P = 262,144 prompt tokens (minutes
a rank), one process below (a spawned process's start costs more than it saves)."""


def _default_workers(config: PlanConfig) -> int:
    return (os.cpu_count() or 1) if config.prompt_tokens >= PARALLEL_REHEARSAL_FROM else 1


def _rehearse(model, config: PlanConfig, report: dict, args) -> str:
    """Rehearse the planned step (`--rehearse`, `--rehearse-steps` of them): adds
    report["rehearsal"], returns its table. It fits when its peak (the worst step's) plus
    the optimizer state and the reserve is within the GPU memory."""
    from longstraw.rehearsal.against_plan import comparison, format_comparison, rehearse_plan

    reh = rehearse_plan(model, config, steps=args.rehearse_steps, allow_position_overflow=args.allow_position_overflow,
                        progress=True,  # a line to stderr a phase: the output (table or JSON) stays on stdout
                        workers=args.rehearse_workers or _default_workers(config))
    entry = comparison(model, config, reh)
    entry["fits"] = entry["peak_bytes_per_rank"] + report["optimizer_bytes"] + config.reserve <= config.gpu_memory
    report["rehearsal"] = entry
    return format_comparison(entry) + ("" if entry["fits"] else "\n  the rehearsed peak does not fit")


def _add_plan_parser(sub) -> None:
    p = sub.add_parser("plan", help="capacity planner: memory per rank and time of one GRPO step (no model loaded)",
                       description="Estimate state, weights, working sets, peak memory per rank and time of one "
                                   "LongStraw GRPO step from a model config. See docs/planner.md.")
    p.add_argument("--model", required=True, help="preset name (e.g. qwen3.6-27b, glm-5.2, tiny-qwen3) or a path "
                                                  "to an HF config.json")
    p.add_argument("--prompt-tokens", type=int, required=True, help="P, shared prompt tokens")
    p.add_argument("--group", type=int, default=None, help="G, responses per group (or --tree)")
    p.add_argument("--response-tokens", type=int, default=None, help="R, tokens per response (or --tree)")
    p.add_argument("--tree", default=None, help="a prefix tree of the responses, levels LENGTHxFANOUT from the "
                                                "prompt down, e.g. 2048x1,256x8 or 1024x2,512x4,128x2 (sets G "
                                                "and R; each shared segment replayed once; docs/planner.md)")
    p.add_argument("--mode", default="detached", choices=["detached", "exact"])
    p.add_argument("--gpus", type=int, default=1, help="W, context-parallel ranks (default 1)")
    p.add_argument("--gpu-memory", default="96GiB", help="memory per rank: 96GB = 96e9 B, 96GiB = 96*2^30 B "
                                                         "(default 96GiB)")
    p.add_argument("--reserve", default="1GiB", help="headroom outside the peak: CUDA context, fragmentation "
                                                     "(default 1GiB)")
    p.add_argument("--dtype", default=None, help="compute/state dtype: bf16, fp16, fp32, fp64 "
                                                 "(default: the config's, else bf16)")
    p.add_argument("--weight-dtype", default=None, help="frozen weight storage: a dtype or nf4/fp8/int8 "
                                                        "(needs --lora-rank; default: --dtype)")
    p.add_argument("--lora-rank", type=int, default=None, help="train LoRA adapters of this rank (default: full)")
    p.add_argument("--lora-targets", default="attention", choices=["attention", "all-linear"],
                   help="LoRA on the token-mixer projections only (default) or on every linear layer")
    p.add_argument("--chunk-size", type=int, default=4096, help="capture chunk (default 4096)")
    p.add_argument("--branch-chunk-size", type=int, default=None, help="replay each branch in pieces of this size "
                                                                       "(default: one piece)")
    p.add_argument("--attention-block-size", type=int, default=1024, help="prompt block of the attention (1024)")
    p.add_argument("--logits-chunk-size", type=int, default=1024, help="lm_head chunk (default 1024)")
    p.add_argument("--self-attention", default="flash", choices=["dense", "fused-nograd", "flash"],
                   help="self part of attention: flash = blockwise with recompute, O(T) kept (today's code); "
                        "dense = plain torch [heads,T,T] scores (to compare); fused-nograd = fused capture, "
                        "dense autograd passes")
    p.add_argument("--gdn-kernel", default="torch", choices=["torch", "fla"],
                   help="GDN chunk kernel: torch = ops/gated_delta.py, fp32 (measured; default); fla = "
                        "flash-linear-attention on CUDA in bf16/fp16 (smaller, estimated)")
    p.add_argument("--first-group", dest="grads_during_capture", action="store_false",
                   help="plan the first group after zero_grad(set_to_none=True): no gradient buffers during "
                        "capture (default: a later group of the batch, gradients already allocated)")
    p.add_argument("--shard-params", action="store_true", help="shard weights/grads/optimizer 1/W (FSDP-style)")
    p.add_argument("--expert-parallel", action="store_true",
                   help="MoE: each rank holds E/W of every layer's experts, never gathered whole (ExecConfig("
                        "expert_parallel=True)); with --shard-params only the non-expert weights are gathered")
    p.add_argument("--replicate-capture", dest="divide_capture", action="store_false",
                   help="plan capture with every token on every rank (divide_capture=False)")
    p.add_argument("--replicate-walk", dest="divide_walk", action="store_false",
                   help="plan exact mode's reverse walk with every token on every rank (divide_walk=False)")
    p.add_argument("--flat-responses", dest="share_response_prefixes", action="store_false",
                   help="with --tree: plan the responses replayed whole, each on its own "
                        "(ExecConfig(share_response_prefixes=False)); --fit searches it with --tree")
    p.add_argument("--offload-state", action="store_true", help="the prompt state's per-token rows in host memory, "
                   "staged one layer at a time (ExecConfig(state_device='cpu')): device peak, host bytes, traffic")
    p.add_argument("--host-bandwidth", dest="host_bandwidth_gbs", type=float, default=50.0,
                   help="host<->device GB/s for the offload traffic's time (default 50, PCIe Gen5 x16 in practice)")
    p.add_argument("--recompute-layers", default=None, type=_auto_on_off, metavar="{auto,on,off}", help="replay and the exact walk recompute each "
                   "decoder layer in backward (ExecConfig.recompute_layers; default auto: where a piece's / walk chunk's graph would "
                   "exceed twice the weights + gradients + state the step holds anyway)")
    p.add_argument("--offload-snapshots", default=None, type=_auto_on_off, metavar="{auto,on,off}",
                   help="exact mode: GDN snapshots (all but the latest) in host memory, one staged back per walk "
                        "chunk (ExecConfig.offload_snapshots; default auto: with --offload-state)")
    p.add_argument("--keep-graph-bytes", default="0", help="exact mode: bytes of capture-chunk graphs kept instead "
                                                           "of recomputed, e.g. 2GiB (ExecConfig.keep_graph_bytes; "
                                                           "default 0: recompute every chunk)")
    p.add_argument("--keep-attention-outputs", action="store_true", default=None,
                   help="exact mode: capture keeps each full-attention layer's output and LSE, so the walk skips "
                        "attention's forward over the prompt (ExecConfig.keep_attention_outputs; default: the "
                        "engine's rule, which on a GPU keeps none)")
    p.add_argument("--score-passes", type=int, default=0, help="no-grad scoring forwards per branch (old/ref "
                                                               "log-probs) from the step's one captured state, "
                                                               "no second capture (the paper: 2; default 0)")
    p.add_argument("--throughput-tflops", type=float, default=400.0,
                   help="effective TFLOP/s per rank (default 400, an H100/H200-class GPU in bf16)")
    _add_fit_flags(p)


def _add_fit_flags(p) -> None:
    """`longstraw plan`'s GPU preset, link, data-parallel, --fit and --json flags."""
    p.add_argument("--gpu", default=None, help="GPU preset: h20, h100, h200, b200, a100-80gb, mi300x (plan/gpus.json, "
                   "each figure with its source): sets --gpu-memory, --throughput-tflops (bf16 dense peak x the stated "
                   "efficiency) and the link bandwidths where they are not given")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8): larger groups talk over "
                                                                 "the inter-node link")
    p.add_argument("--intra-node-bandwidth", dest="intra_node_gbs", type=float, default=360.0,
                   help="effective one-direction intra-node GB/s per GPU (default 360: NVLink 900 / 2 x 0.8)")
    p.add_argument("--inter-node-bandwidth", dest="inter_node_gbs", type=float, default=40.0,
                   help="effective per-GPU inter-node GB/s (default 40: 400 Gb/s x 0.8)")
    p.add_argument("--data-parallel", type=int, default=1, help="data-parallel replicas of the W ranks: one "
                                                                "all-reduce of the trainable gradients per step")
    p.add_argument("--fit", action="store_true",
                   help="search pieces, chunk size, recompute, state offload, snapshots on host, expert parallelism, "
                        "parameter sharding, keep_graph_bytes (and --mode if not given) for the fastest setting whose "
                        "peak fits --gpu-memory (or the --gpu preset's) minus --reserve; a flag given pins its option. "
                        "Prints the flags and the ExecConfig; exit 3 when nothing fits (plan/fit.py)")
    p.add_argument("--sweep", default=None, help="FIELD=V1,V2,...: one plan (with --fit: one fit) per value, e.g. "
                   "gpus=8,16,32,64 or prompt_tokens=1048576,2097152 (plan/sweep.py)")
    p.add_argument("--plot", default=None, help="with --sweep: draw time, memory per rank and communication share "
                                                "against the swept field to this PNG (needs matplotlib)")
    p.add_argument("--images", type=int, default=0, help="images in the prompt (Qwen3.5 / 3.6): adds the vision "
                   "tower's parameters, the image rows the state keeps and the largest image's working set")
    p.add_argument("--image-tokens", type=int, default=0, help="merged tokens of the largest image (with --images)")
    p.add_argument("--shard-block-size", type=int, default=None, help="context parallelism: positions per "
                   "round-robin block of the state's deal over the ranks (ExecConfig.shard_block_size; default: "
                   "--attention-block-size)")
    p.add_argument("--generate", action="store_true", help="the responses are sampled by Engine.generate from the "
                   "state the step reuses (longstraw train, the TRL trainer): adds the 'generate' phase, the G branches "
                   "decoding together (plan/generate.py)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--rehearse", action="store_true",
                   help="also run the planned step (with --fit: the chosen one) on fake tensors (ls.rehearse, one "
                        "rank, CPU branches) and print the planner's and the rehearsal's peak per phase side by side "
                        "(JSON: \"rehearsal\"; docs/rehearse.md)")
    p.add_argument("--rehearse-steps", type=int, default=1, metavar="N",
                   help="--rehearse: steps to rehearse one after the other (gradients set to None between): a leak "
                        "shows as a later step's higher peak (JSON \"step_peaks\")")
    p.add_argument("--rehearse-workers", type=_positive_int, default=None, metavar="N",
                   help="--rehearse: rehearse up to N of the ranks at once, each in a process of its own (default: "
                        "this machine's CPUs from P = 262,144, else 1; --gpus > 1 rehearses rank 0 and rank W - 1, "
                        "or the rank with the most experts)")
    p.add_argument("--allow-position-overflow", action="store_true",
                   help="--rehearse: let P + R pass the model's max_position_embeddings, as a run with "
                        "ExecConfig(allow_position_overflow=True) does (the paper's 2.1M-token runs do)")


def train(args) -> int:
    from longstraw.train import TrainConfig, config_from_args
    from longstraw.train import train as run_training

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}
    cfg = config_from_args(values, args.config)
    rank, _ = _init_torchrun()  # under torchrun: context parallelism over every rank, rank 0 writes the files
    try:
        summary = run_training(cfg)
    except DoesNotFitError as exc:  # fit_config's changes, said as this command's flags
        raise fit_advice.again(exc, "train", prefix=f"--memory-budget {cfg.memory_budget}: ") from None
    if rank in (None, 0):
        print(json.dumps(summary))
    return 0


def field_docs(cls) -> dict[str, str]:
    """The docstring written under each field of a dataclass (its source's string after
    the annotated assignment), by field name: the flags' help text."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            docs[node.target.id] = " ".join(str(after.value.value).split()).replace("%", "%%")
    return docs


_TRAIN_ALIASES = {"task_name": ["--task"]}  # TrainConfig.task() is a method, so the field is task_name


def _train_choices(cls) -> dict[str, list]:
    """The values `--task`, `--model`, `--arm` and `--loss-type` accept (argparse `choices=`, listed in --help)."""
    from longstraw.config import LOSS_TYPES
    from longstraw.tasks.episodes import TASKS

    return {"task_name": list(TASKS), "model": sorted(cls.presets), "arm": list(cls.arms),
            "loss_type": list(LOSS_TYPES)}


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose bad flag is one line, `longstraw: ConfigError: ...`, exit 2 (as the
    library's own errors print), instead of the usage block."""

    def error(self, message):
        print(f"longstraw: ConfigError: {message} (see `{self.prog} --help`)", file=sys.stderr)
        sys.exit(2)


def _add_train_parser(sub) -> None:
    from longstraw.train import TrainConfig

    p = sub.add_parser("train", help="GRPO training loop on a long-context task: key-value recall, or the tool-lookup "
                                     "agent task (--task tool_lookup) (tiny model, no download)",
                       description="Warm start, then GRPO at long P with engine.generate + engine.step; logs "
                                   "JSONL to --out-dir, checkpoints and resumes. See docs/learning.md.")
    p.add_argument("--config", default=None, help="JSON file of TrainConfig fields; flags override it")
    docs = field_docs(TrainConfig)
    choices = _train_choices(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        doc = docs.get(f.name, "")
        flags = ["--" + f.name.replace("_", "-")] + _TRAIN_ALIASES.get(f.name, [])
        kind = f.type if isinstance(f.type, str) else f.type.__name__
        if kind == "bool":
            p.add_argument(*flags, dest=f.name, default=None, action=argparse.BooleanOptionalAction,
                           help=f"{doc} (default {f.default})".strip())
        else:
            cast = {"int": int, "float": float}.get(kind.split(" |")[0], str)
            p.add_argument(*flags, dest=f.name, default=None, type=cast, choices=choices.get(f.name),
                           help=f"{doc} (default {f.default})".strip())


def _add_demo_parser(sub) -> None:
    from longstraw.tiny import DEFAULT_FAMILY, TINY_CONFIGS

    p = sub.add_parser("demo", help="one GRPO iteration (generate, reward, step, optimizer step) on a tiny "
                                    "built-in model (no download)")
    p.add_argument("--prompt-tokens", type=int, default=32768, help="P (default 32768)")
    p.add_argument("--group", type=int, default=8, help="G responses (default 8)")
    p.add_argument("--response-tokens", type=int, default=256, help="R, max new tokens per response (default 256)")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate of the optimizer step (default 1e-5)")
    p.add_argument("--chunk-size", type=int, default=defaults.CHUNK_SIZE,
                   help=f"capture chunk (default {defaults.CHUNK_SIZE})")
    p.add_argument("--mode", default=defaults.MODE, choices=list(defaults.MODES))
    p.add_argument("--family", default=DEFAULT_FAMILY, choices=sorted(TINY_CONFIGS),
                   help=f"tiny model family (default {DEFAULT_FAMILY}: Qwen3.6-shaped hybrid GDN + attention)")
    p.add_argument("--branch-chunk-size", type=int, default=None, help="replay each branch in pieces of this size")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--seed", type=int, default=0)


def _add_grpo_parser(sub) -> None:
    """Listed in `longstraw --help`; its flags are TRL's (`longstraw grpo --help`, grpo_cli.py)."""
    sub.add_parser("grpo", add_help=False, help="TRL's GRPO script (trl grpo flags: --model_name_or_path, "
                                                 "--dataset_name, --reward_funcs, GRPOConfig, PEFT) with "
                                                 "LongStrawGRPOTrainer; see docs/your_model.md")


def _add_export_parser(sub) -> None:
    p = sub.add_parser("export", help="a DCP (torchrun template) or `longstraw train` checkpoint to a Hugging Face "
                                      "folder that from_pretrained loads (export.py)")
    p.add_argument("checkpoint", help="a DCP step-N folder, or a longstraw train checkpoint.pt (or its out-dir)")
    p.add_argument("out", help="the HF folder to write (config.json, model.safetensors, the tokenizer if known)")
    p.add_argument("--model", default=None, help="for a DCP checkpoint: the architecture, tiny:<family> or an HF "
                                                 "folder / config.json (a folder's tokenizer is copied too)")
    p.add_argument("--tokenizer", default=None, help="a tokenizer folder to save with the model")
    p.add_argument("--max-position-embeddings", type=int, default=None,
                   help="for a DCP checkpoint: the positions the run's model had")
    p.add_argument("--merge", action="store_true", help="a PEFT adapter folder: merge it into its base model "
                                                        "(default: write the adapter folder)")


def export(args) -> int:
    from longstraw.export import export as run_export

    out = run_export(args.checkpoint, args.out, model=args.model, tokenizer=args.tokenizer,
                     max_position_embeddings=args.max_position_embeddings, merge=args.merge)
    print(f"longstraw export: wrote {out}")
    return 0


def grpo(argv) -> int:
    from longstraw import grpo_cli

    return grpo_cli.main(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    quiet.install()  # warnings that are not the user's to act on (quiet.py)
    if argv[:1] == ["grpo"]:  # TRL's own parser reads its flags
        try:
            return grpo(argv[1:])
        except LongStrawError as exc:
            print(f"longstraw: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 2
    parser = _Parser(prog="longstraw", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    torch_free = argv[:1] == ["plan"]  # only the planner's parser: nothing imports torch
    if not torch_free:
        _add_demo_parser(sub)
    _add_plan_parser(sub)
    if not torch_free:
        _add_train_parser(sub)
        _add_grpo_parser(sub)
        _add_export_parser(sub)
    args = parser.parse_args(argv)

    try:
        if args.command == "train":
            return train(args)
        if args.command == "export":
            return export(args)
        return plan(args, argv) if args.command == "plan" else demo(args)
    except LongStrawError as exc:
        print(f"longstraw: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
