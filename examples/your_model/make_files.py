"""Your model, your data, your reward: the files a new user has, made here offline, and
the one `longstraw grpo` command that trains on them.

Writes to --dir: `model/` (a tiny Qwen3-shaped checkpoint and its tokenizer, saved with
`save_pretrained`: random weights, nothing downloaded), `prompts.jsonl` (long key-value
recall prompts "k v k v ... 3 k" with an `answer` column), and uses `rewards.py` next to
this file. Prints the command; `--run` runs it too.

    python examples/your_model/make_files.py --dir /tmp/your_model            # print the command
    python examples/your_model/make_files.py --dir /tmp/your_model --run      # and train
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import sys

import torch

from longstraw import cli
from longstraw.integrations.chat import token_id_tokenizer
from longstraw.tiny import tiny_model

VOCAB, EOS, QUERY = 4096, 1, 3
KEYS, VALUES = range(100, 2100), range(2100, 2116)
HERE = os.path.dirname(os.path.abspath(__file__))


def kv_prompt(rng: random.Random, prompt_tokens: int) -> dict:
    """{"prompt": "k v k v ... 3 k", "answer": v}: about prompt_tokens tokens."""
    keys = rng.sample(KEYS, min((prompt_tokens - 2) // 2, len(KEYS)))
    table = {k: rng.choice(VALUES) for k in keys}
    asked = rng.choice(keys)
    words = [str(t) for k in keys for t in (k, table[k])] + [str(QUERY), str(asked)]
    return {"prompt": " ".join(words), "answer": table[asked]}


def make_files(folder: str, prompt_tokens: int, prompts: int, seed: int = 0) -> None:
    torch.manual_seed(seed)
    model = tiny_model("qwen3", dtype=torch.float32, vocab_size=VOCAB, max_position_embeddings=prompt_tokens + 64)
    model.save_pretrained(os.path.join(folder, "model"))
    token_id_tokenizer(VOCAB, eos_token_id=EOS).save_pretrained(os.path.join(folder, "model"))
    rng = random.Random(seed)
    with open(os.path.join(folder, "prompts.jsonl"), "w") as f:
        for _ in range(prompts):
            f.write(json.dumps(kv_prompt(rng, prompt_tokens)) + "\n")


def command(folder: str, steps: int, chunk_size: int) -> list[str]:
    """The `longstraw grpo` flags: TRL's, plus --longstraw_*."""
    return ["grpo", "--model_name_or_path", os.path.join(folder, "model"),
            "--dataset_name", os.path.join(folder, "prompts.jsonl"),
            "--reward_funcs", f"{os.path.join(HERE, 'rewards.py')}:first_token_is_answer",
            "--output_dir", os.path.join(folder, "out"), "--max_steps", str(steps),
            "--per_device_train_batch_size", "8", "--num_generations", "8", "--max_completion_length", "4",
            "--learning_rate", "3e-4", "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", str(steps),
            "--report_to", "none", "--use_cpu", "--longstraw_chunk_size", str(chunk_size)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/longstraw_your_model")
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--chunk-size", type=int, default=1024)
    ap.add_argument("--run", action="store_true", help="run the command after printing it")
    args = ap.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    make_files(args.dir, args.prompt_tokens, args.prompts)
    flags = command(args.dir, args.steps, args.chunk_size)
    print("longstraw " + " ".join(shlex.quote(f) for f in flags), flush=True)
    return cli.main(flags) if args.run else 0


if __name__ == "__main__":
    sys.exit(main())
