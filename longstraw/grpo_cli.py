"""`longstraw grpo`: TRL's GRPO script (`trl grpo`) with `LongStrawGRPOTrainer` underneath.

    longstraw grpo --model_name_or_path ./my_model --dataset_name prompts.jsonl \
        --reward_funcs rewards.py:exact_match --output_dir out --max_steps 100 \
        [--config grpo.yaml] [every GRPOConfig flag] [--use_peft --lora_r 16 ...] \
        [--longstraw_mode exact --longstraw_memory_budget 80GiB ...]

The flags are TRL's own (`GRPOScriptArguments`, `GRPOConfig`, `ModelConfig`,
`DatasetMixtureConfig`, parsed by `trl.TrlParser`, so `--config FILE.yaml` works as in
TRL), plus `LongStrawArguments` (the trainer's `longstraw_*` keywords). Three defaults
differ from TRL's (`CLI_DEFAULTS`): bf16=False, disable_dropout=True, lora_dropout=0.

Before any model is loaded (`check_inputs`), a `ConfigError` (exit 2) for: an unknown
flag, a dataset that does not load or is empty, a missing `prompt` column, a reward
function that does not import or cannot take TRL's keywords, chat prompts without a chat
template, a prompt that with `max_completion_length` runs past the model's positions (the
longest one's index and length), and for an `image` / `images` column the checks of
`grpo_images.py` (an image that does not open, a text model, text prompts). Reading the
config, the tokenizer or processor (`integrations/vlm_processor.py`: a Qwen3.5 / 3.6 VLM's
without torchvision) and the dataset is all it loads for that.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass, field

import datasets
from transformers import AutoConfig
from trl import DatasetMixtureConfig, GRPOConfig, ModelConfig, TrlParser, get_dataset, get_peft_config
from trl import get_quantization_config
from trl.data_utils import is_conversational
from trl.rewards import accuracy_reward, get_soft_overlong_punishment, reasoning_accuracy_reward, think_format_reward
from trl.scripts.grpo import GRPOScriptArguments

from longstraw import defaults, grpo_images
from longstraw.config import ExecConfig
from longstraw.errors import ConfigError
from longstraw.integrations.trl import LongStrawGRPOTrainer
from longstraw.integrations.vlm_processor import load_processor
from longstraw.parallel.nonfinite import DEFAULT_MAX_NONFINITE_STEPS

DATA_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
"""A local dataset file's suffix -> the `datasets` builder that reads it."""

TRL_REWARD_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
"""What TRL 1.16's `_calculate_rewards` passes every reward function, besides the dataset's other columns."""


CLI_DEFAULTS = dict(bf16=False, disable_dropout=True, lora_dropout=0.0)
"""Where `longstraw grpo`'s defaults differ from `trl grpo`'s: LongStraw runs the model in its
own dtype (no autocast; `--dtype bfloat16` loads it in bf16) and refuses dropout (capture and
replay must see the same function)."""


@dataclass
class LongStrawArguments:
    """The `--longstraw_*` flags: `LongStrawGRPOTrainer`'s keywords and the engine's
    `ExecConfig` fields that a run usually sets."""

    longstraw_mode: str = field(default=defaults.MODE, metadata={
        "help": "detached (gradient through the response tokens) or exact (the full-sequence gradient)",
        "choices": list(defaults.MODES)})
    longstraw_chunk_size: int = field(default=defaults.CHUNK_SIZE, metadata={"help": "prompt capture chunk (tokens)"})
    longstraw_branch_chunk_size: int | None = field(default=None, metadata={
        "help": "replay each response branch in pieces of this many tokens"})
    longstraw_keep_states: bool = field(default=True, metadata={
        "help": "keep each prompt's state from generation to its update (False: capture again at the update)"})
    longstraw_replica_check_every: int = field(default=0, metadata={
        "help": "every N optimizer steps, check that all processes hold the same weights (0: off)"})
    longstraw_context_parallel_size: int = field(default=1, metadata={
        "help": "ranks that share one prompt (context parallelism; must divide the world size)"})
    longstraw_fsdp: bool = field(default=False, metadata={
        "help": "FSDP2 of the decoder layers over each context-parallel group (needs context_parallel_size >= 2)"})
    longstraw_max_nonfinite_steps: int = field(default=DEFAULT_MAX_NONFINITE_STEPS, metadata={
        "help": "NaN/inf steps in a row (skipped) before training stops"})
    longstraw_memory_budget: str | None = field(default=None, metadata={
        "help": "fit the engine's config to this memory per rank, e.g. 80GiB (with --longstraw_prompt_tokens)"})
    longstraw_prompt_tokens: int | None = field(default=None, metadata={
        "help": "the prompt length the memory budget is fitted for (default: the dataset's longest prompt)"})

    def exec_config(self):
        """The engine's `ExecConfig` from the flags."""
        return ExecConfig(mode=self.longstraw_mode, chunk_size=self.longstraw_chunk_size,
                          branch_chunk_size=self.longstraw_branch_chunk_size)

    def trainer_kwargs(self, longest_prompt: int | None) -> dict:
        """The `longstraw_*` keywords of `LongStrawGRPOTrainer`."""
        prompt_tokens = self.longstraw_prompt_tokens
        if self.longstraw_memory_budget is not None and prompt_tokens is None:
            prompt_tokens = longest_prompt
        return dict(longstraw_config=self.exec_config(), longstraw_keep_states=self.longstraw_keep_states,
                    longstraw_replica_check_every=self.longstraw_replica_check_every,
                    longstraw_context_parallel_size=self.longstraw_context_parallel_size,
                    longstraw_fsdp=self.longstraw_fsdp, longstraw_max_nonfinite_steps=self.longstraw_max_nonfinite_steps,
                    longstraw_memory_budget=self.longstraw_memory_budget, longstraw_prompt_tokens=prompt_tokens)


# ----------------------------------------------------------------------------
# flags


def make_parser():
    """TRL's GRPO script parser (its four dataclasses) plus `LongStrawArguments`; bf16 off by default."""
    parser = TrlParser((GRPOScriptArguments, GRPOConfig, ModelConfig, DatasetMixtureConfig, LongStrawArguments),
                       prog="longstraw grpo")
    parser.set_defaults(**CLI_DEFAULTS)
    return parser


def parse(argv):
    """(script_args, training_args, model_args, dataset_args, longstraw_args) from the flags
    and `--config`; an unknown flag or config key is a `ConfigError`."""
    parser = make_parser()
    try:
        return parser.parse_args_and_config(args=list(argv), fail_with_unknown_args=True)
    except ValueError as exc:
        message = str(exc)
        if "not used by the HfArgumentParser" in message or "Unknown arguments" in message:
            raise ConfigError(f"{message.split(': ', 1)[-1]}: not a flag of `longstraw grpo` (TRL's GRPO script "
                              "flags and --longstraw_*; see `longstraw grpo --help`)") from None
        raise ConfigError(message) from None


# ----------------------------------------------------------------------------
# the dataset


def load_local_or_hub_dataset(name: str, config: str | None = None, streaming: bool = False):
    """`name` as a `datasets` DatasetDict: a JSONL/JSON/Parquet/CSV file (split "train"), a
    `save_to_disk` folder, a folder of data files, or a hub id (as TRL's script)."""
    try:
        if os.path.isfile(name):
            suffix = os.path.splitext(name)[1].lower()
            if suffix not in DATA_FILE_BUILDERS:
                raise ConfigError(f"--dataset_name {name}: a file must end in one of {sorted(DATA_FILE_BUILDERS)}")
            if _blank(name):
                raise ConfigError(f"--dataset_name {name}: the file is empty: nothing to train on; add rows (one "
                                  "prompt per row)")
            return datasets.load_dataset(DATA_FILE_BUILDERS[suffix], data_files=name, streaming=streaming)
        if os.path.isdir(name) and any(os.path.exists(os.path.join(name, f))
                                       for f in ("dataset_dict.json", "state.json", "dataset_info.json")):
            loaded = datasets.load_from_disk(name)
            return loaded if isinstance(loaded, datasets.DatasetDict) else datasets.DatasetDict(train=loaded)
        if not os.path.exists(name) and (name.startswith((".", "/", "~")) or os.path.splitext(name)[1] in
                                         DATA_FILE_BUILDERS):
            raise ConfigError(f"--dataset_name {name}: no such file or folder")
        return datasets.load_dataset(name, name=config, streaming=streaming)
    except ConfigError:
        raise
    except Exception as exc:  # datasets raises many kinds; the user needs the name and the reason
        raise ConfigError(f"--dataset_name {name}: cannot load it ({type(exc).__name__}: {exc})") from None


def _blank(path: str) -> bool:
    """Whether the file holds nothing but whitespace (`datasets` fails on it with a bare StopIteration)."""
    if os.path.getsize(path) > 4096:
        return False
    with open(path, "rb") as f:
        return not f.read().strip()


def train_split(dataset, split: str):
    """The training split, checked: it exists, is not empty, and has a "prompt" column."""
    if split not in dataset:
        raise ConfigError(f"--dataset_train_split {split}: the dataset has the splits {sorted(dataset)}; "
                          "pass one of them")
    train = dataset[split]
    columns = list(train.column_names or [])
    if "prompt" not in columns:
        raise ConfigError(f"the dataset has no 'prompt' column (its columns: {columns}); rename the column holding "
                          "the prompts to 'prompt' (a string, or a list of chat messages)")
    if hasattr(train, "__len__") and len(train) == 0:
        raise ConfigError(f"the dataset's {split!r} split is empty: nothing to train on; add rows (one prompt per "
                          "row), or pass the split that holds them with --dataset_train_split")
    return train


# ----------------------------------------------------------------------------
# reward functions


def _trl_registry() -> dict:
    return {"accuracy_reward": accuracy_reward, "reasoning_accuracy_reward": reasoning_accuracy_reward,
            "think_format_reward": think_format_reward,
            "get_soft_overlong_punishment": get_soft_overlong_punishment(max_completion_len=1280,
                                                                         soft_punish_cache=256)}


def _import_reward(spec: str):
    """`module:function`, `path/file.py:function` or TRL's dotted `module.function`."""
    if ":" in spec:
        where, name = spec.rsplit(":", 1)
    elif "." in spec:
        where, name = spec.rsplit(".", 1)
    else:
        raise ConfigError(f"--reward_funcs {spec}: not one of TRL's {sorted(_trl_registry())}, nor "
                          "module:function, path/to/file.py:function or module.function")
    try:
        if where.endswith(".py"):
            if not os.path.isfile(where):
                raise ConfigError(f"--reward_funcs {spec}: no such file {where}; give the reward file's path "
                                  "(absolute, or relative to where the command runs)")
            module_spec = importlib.util.spec_from_file_location(f"longstraw_reward_{abs(hash(where))}", where)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            sys.path.insert(0, os.getcwd())  # as TRL's script: a module next to where it runs
            module = importlib.import_module(where)
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"--reward_funcs {spec}: importing {where} failed ({type(exc).__name__}: {exc}); fix that "
                          "error in the module (or install what it imports)") from None
    if not hasattr(module, name):
        functions = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ConfigError(f"--reward_funcs {spec}: {where} has no {name!r}; its functions: {functions}")
    return getattr(module, name)


def check_reward_signature(spec: str, func, columns) -> None:
    """A `ConfigError` unless `func(prompts=, completions=, completion_ids=, trainer_state=,
    log_extra=, log_metric=, **other dataset columns)` binds (TRL's reward call)."""
    if not callable(func):
        raise ConfigError(f"--reward_funcs {spec}: {type(func).__name__} is not callable")
    passed = set(TRL_REWARD_KEYWORDS) | {c for c in columns if c not in ("prompt", "completion", "completion_ids")}
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return  # a builtin without a signature: TRL's own call will tell
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    missing = [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               and p.name not in passed]
    positional = [p.name for p in params if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    unexpected = [] if takes_any else sorted(passed - {p.name for p in params})
    if missing or positional or unexpected:
        why = "; ".join(filter(None, [
            missing and f"it needs {missing}, which TRL does not pass (dataset columns: {sorted(columns)})",
            positional and f"{positional} are positional-only (TRL passes keywords)",
            unexpected and f"it takes no {unexpected} (add **kwargs)"]))
        raise ConfigError(f"--reward_funcs {spec}: wrong signature {inspect.signature(func)}: {why}. TRL calls "
                          "reward(prompts=..., completions=..., completion_ids=..., **kwargs) and expects one float "
                          "(or None) per completion")


def load_reward_funcs(specs, columns) -> list:
    """TRL's reward names, or imported functions checked against TRL's reward call."""
    registry = _trl_registry()
    funcs = []
    for spec in specs or []:
        func = registry[spec] if spec in registry else _import_reward(spec)
        check_reward_signature(spec, func, columns)
        funcs.append(func)
    return funcs


# ----------------------------------------------------------------------------
# prompt lengths


def load_processing_class(model_args, training_args):
    """The processor TRL's trainer would load for the model (left padding and truncation):
    a Qwen3.5 / 3.6 VLM's images and tokenizer without the video processor, a text model's
    tokenizer (`integrations/vlm_processor.py`)."""
    try:
        return load_processor(model_args.model_name_or_path, revision=model_args.model_revision,
                              trust_remote_code=training_args.trust_remote_code, truncation_side="left",
                              padding_side="left")
    except Exception as exc:
        raise ConfigError(f"--model_name_or_path {model_args.model_name_or_path}: cannot load its tokenizer or "
                          f"processor ({type(exc).__name__}: {exc})") from None


def model_config(model_args, training_args):
    """The model's config (`config.json`), without its weights."""
    try:
        return AutoConfig.from_pretrained(model_args.model_name_or_path, revision=model_args.model_revision,
                                          trust_remote_code=training_args.trust_remote_code)
    except Exception as exc:
        raise ConfigError(f"--model_name_or_path {model_args.model_name_or_path}: cannot load its config "
                          f"({type(exc).__name__}: {exc})") from None


def prompt_lengths(train, tokenizer, training_args) -> list[int]:
    """Each prompt's token count as TRL tokenizes it (the chat template with the generation
    prompt for conversational prompts, else the plain text)."""
    kwargs = dict(training_args.chat_template_kwargs or {})
    lengths = []
    for example in train:
        if is_conversational(example):
            ids = tokenizer.apply_chat_template(example["prompt"], add_generation_prompt=True, tokenize=True,
                                                return_dict=True, **kwargs)["input_ids"]
        else:
            ids = tokenizer(text=example["prompt"])["input_ids"]
        lengths.append(len(ids))
    return lengths


def check_chat_template(train, processing_class, model_name: str) -> None:
    """A `ConfigError` when the prompts are chat messages and the tokenizer has no chat template."""
    first = next(iter(train), None)
    if first is not None and is_conversational(first) and not getattr(processing_class, "chat_template", None):
        raise ConfigError(f"the prompts are chat messages, but the tokenizer in {model_name} has no chat template: "
                          "save one with it (tokenizer.chat_template = '...'; tokenizer.save_pretrained(folder)), or "
                          "write the prompts as text")


def check_prompt_lengths(lengths, positions: int | None, max_completion_length: int, *, images: bool = False) -> None:
    """A `ConfigError` naming the longest prompt when it plus the completion runs past the
    positions (`images`: the lengths count each image at its tokens)."""
    if positions is None or not lengths:
        return
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    if lengths[longest] + max_completion_length > positions:
        too_long = sum(n + max_completion_length > positions for n in lengths)
        raise ConfigError(f"prompt {longest} (the longest) has {lengths[longest]:,} tokens; with "
                          f"max_completion_length={max_completion_length} it runs past the model's "
                          f"max_position_embeddings={positions:,} ({too_long} of {len(lengths)} prompts do); drop or "
                          f"shorten those prompts{' (each image counts at its tokens: fewer or smaller images)' if images else ''}, "
                          "or lower --max_completion_length")


# ----------------------------------------------------------------------------
# the run


@dataclass
class Prepared:
    """What `check_inputs` read and checked, for `build_trainer`."""

    train_dataset: object
    reward_funcs: list
    processing_class: object
    longest_prompt: int | None


def check_inputs(script_args, training_args, model_args, dataset_args) -> Prepared:
    """Every check that needs no model: the dataset, the rewards, the prompt lengths."""
    if model_args.model_name_or_path is None:
        raise ConfigError("--model_name_or_path is required (a local folder saved with save_pretrained, or a hub id)")
    if dataset_args.datasets:
        dataset = get_dataset(dataset_args)
    elif script_args.dataset_name:
        dataset = load_local_or_hub_dataset(script_args.dataset_name, script_args.dataset_config,
                                            script_args.dataset_streaming)
    else:
        raise ConfigError("--dataset_name is required (a JSONL/JSON/Parquet/CSV file, a save_to_disk folder or a "
                          "hub id)")
    train = train_split(dataset, script_args.dataset_train_split)
    if not script_args.reward_funcs and not script_args.reward_model_name_or_path:
        raise ConfigError("no reward: pass --reward_funcs (TRL's names, module:function or file.py:function) "
                          "or --reward_model_name_or_path")
    reward_funcs = load_reward_funcs(script_args.reward_funcs, train.column_names)
    if script_args.reward_model_name_or_path:
        reward_funcs.insert(0, script_args.reward_model_name_or_path)
    config = model_config(model_args, training_args)
    processing_class = load_processing_class(model_args, training_args)
    column = grpo_images.image_column(train)
    if column is not None:  # a text model given images: said before its tokenizer's chat template
        grpo_images.check_model(column, processing_class, config.model_type)
    check_chat_template(train, processing_class, model_args.model_name_or_path)
    if script_args.dataset_streaming:  # rows are read as training reaches them: nothing to check ahead
        return Prepared(train, reward_funcs, processing_class, None)
    if column is not None:
        train, lengths = grpo_images.image_dataset(train, column, processing_class, config.model_type,
                                                   training_args.chat_template_kwargs)
    else:
        tokenizer = getattr(processing_class, "tokenizer", processing_class)
        lengths = prompt_lengths(train, processing_class if hasattr(processing_class, "apply_chat_template")
                                 else tokenizer, training_args)
    check_prompt_lengths(lengths, getattr(config.get_text_config(), "max_position_embeddings", None),
                         training_args.max_completion_length, images=column is not None)
    return Prepared(train, reward_funcs, processing_class, max(lengths))


def build_trainer(script_args, training_args, model_args, dataset_args, longstraw_args, prepared: Prepared = None):
    """`LongStrawGRPOTrainer` as TRL's script builds `GRPOTrainer` (the model loaded by the
    trainer from `--model_name_or_path` with TRL's `model_init_kwargs`)."""
    prepared = prepared or check_inputs(script_args, training_args, model_args, dataset_args)
    model_init_kwargs = dict(revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code,
                             attn_implementation=model_args.attn_implementation, dtype=model_args.dtype)
    model_init_kwargs.update(training_args.model_init_kwargs or {})
    training_args.model_init_kwargs = model_init_kwargs
    return LongStrawGRPOTrainer(model=model_args.model_name_or_path, reward_funcs=prepared.reward_funcs,
                                args=training_args, train_dataset=prepared.train_dataset,
                                processing_class=prepared.processing_class,
                                quantization_config=get_quantization_config(model_args),
                                peft_config=get_peft_config(model_args),
                                **longstraw_args.trainer_kwargs(prepared.longest_prompt))


def main(argv) -> int:
    """Parse, check, build, train (resuming with --resume_from_checkpoint), save to output_dir."""
    script_args, training_args, model_args, dataset_args, longstraw_args = parse(argv)
    trainer = build_trainer(script_args, training_args, model_args, dataset_args, longstraw_args)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"longstraw grpo: model saved to {training_args.output_dir}")
    trainer.end() if hasattr(trainer, "end") else None
    return 0
