"""`longstraw grpo` on an image dataset (longstraw/grpo_images.py, integrations/vlm_processor.py).

The user's files, made offline: a tiny Qwen3.5 VLM checkpoint with its processor saved
beside it (`tiny_vlm_processor().save_pretrained`, no video processor, no torchvision),
PNG screenshots, a JSONL of chat prompts with an `images` column of paths, a reward file.
One exact-mode step trains the text model and the vision tower; `output_dir` loads with
`from_pretrained`, its processor with `load_processor`. Each bad image input is a one-line
`longstraw: ConfigError` with exit 2 before any model loads.
"""

import json

import pytest
import torch

from longstraw import cli
from longstraw.tiny import tiny_vlm
from longstraw.tiny_vision import screenshots, tiny_vlm_processor
from tests.integrations.test_trl_images import SMALL

trl = pytest.importorskip("trl")
from transformers import AutoModelForImageTextToText  # noqa: E402

from longstraw.integrations.vlm_processor import ImagesProcessor, load_processor  # noqa: E402
from longstraw.integrations.chat import token_id_tokenizer  # noqa: E402
from tests.reference import tiny_model  # noqa: E402
from tests.test_grpo_cli import _error  # noqa: E402

REWARDS = '''
def weighted(completion_ids, **kwargs):
    return [float(sum((k + 1) * t for k, t in enumerate(c)) % 11) for c in completion_ids]
'''
POSITIONS = 128


def _rows(folder, shots):
    return [{"prompt": [{"role": "user", "content": "12 7 3"}], "images": [str(shots[0]), str(shots[1])]},
            {"prompt": [{"role": "user", "content": "5 9"}], "images": [str(shots[2]), str(shots[3])]}]


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def vlm_workspace(tmp_path):
    """A saved tiny VLM + its processor, four screenshots, a JSONL with an images column, a reward file."""
    text = {**SMALL["text"], "max_position_embeddings": POSITIONS}
    tiny_vlm(dtype=torch.float32, **{**SMALL, "text": text}).save_pretrained(tmp_path / "model")
    tiny_vlm_processor().save_pretrained(tmp_path / "model")
    shots = []
    for k, image in enumerate(screenshots(4, height=64, width=96, seed=3)):
        shots.append(tmp_path / f"shot{k}.png")
        image.save(shots[-1])
    _write(tmp_path / "data.jsonl", _rows(tmp_path, shots))
    (tmp_path / "rewards.py").write_text(REWARDS)
    return tmp_path


def _flags(ws, *extra, data="data.jsonl", model="model"):
    return ["grpo", "--model_name_or_path", str(ws / model), "--dataset_name", str(ws / data),
            "--reward_funcs", f"{ws / 'rewards.py'}:weighted", "--output_dir", str(ws / "out"),
            "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "3",
            "--max_steps", "1", "--learning_rate", "5e-2", "--use_cpu", "--report_to", "none",
            "--save_strategy", "no", "--seed", "0", "--longstraw_chunk_size", "8", *extra]


def _same_as_the_tiny_processor(processor) -> None:
    assert isinstance(processor, ImagesProcessor)
    messages = [[{"role": "user", "content": [{"type": "image", "image": screenshots(1)[0]},
                                              {"type": "text", "text": "12 7 2100"}]}]]
    ours, reference = (p.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
                       for p in (processor, tiny_vlm_processor()))
    assert ours["input_ids"] == reference["input_ids"]
    torch.testing.assert_close(ours["pixel_values"], reference["pixel_values"], rtol=0, atol=0)


def test_a_saved_vlm_processor_loads_back_without_torchvision(vlm_workspace):
    """HF's `AutoProcessor` needs torchvision for this folder (its video processor), and
    `AutoTokenizer` swaps in Qwen3_5Tokenizer; `load_processor` gives the processor saved."""
    processor = load_processor(str(vlm_workspace / "model"), padding_side="left")
    _same_as_the_tiny_processor(processor)
    assert processor.tokenizer.padding_side == "left"
    saved = json.loads((vlm_workspace / "model" / "processor_config.json").read_text())
    assert saved["processor_class"] == "Qwen3VLProcessor"  # what a real Qwen3.5 checkpoint names


@pytest.mark.slow  # 3.5 s idle, 12 s on loaded cores
def test_one_step_on_an_image_dataset_writes_a_checkpoint_that_loads(vlm_workspace):
    ws = vlm_workspace
    assert cli.main(_flags(ws, "--longstraw_mode", "exact")) == 0
    before = AutoModelForImageTextToText.from_pretrained(ws / "model").state_dict()
    after = AutoModelForImageTextToText.from_pretrained(ws / "out").state_dict()
    assert after.keys() == before.keys()
    changed = {n for n, p in after.items() if not torch.equal(p, before[n])}
    assert any("visual" in n for n in changed), "exact mode trains the vision tower"
    assert any("language_model" in n for n in changed)
    _same_as_the_tiny_processor(load_processor(str(ws / "out")))  # the processor saved with the model


def test_bad_image_inputs_are_one_line_errors_before_the_model_loads(vlm_workspace, capsys, monkeypatch):
    ws = vlm_workspace

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(trl.trainer.grpo_trainer, "create_model_from_path", no_model)
    rows = [json.loads(line) for line in (ws / "data.jsonl").read_text().splitlines()]
    (ws / "not_an_image.png").write_text("not a png")

    _write(ws / "missing.jsonl", [rows[0], {**rows[1], "images": [rows[1]["images"][0], str(ws / "gone.png")]}])
    err = _error(capsys, _flags(ws, data="missing.jsonl"))
    assert "row 1: image 1" in err and "gone.png" in err and "does not open" in err

    _write(ws / "corrupt.jsonl", [{**rows[0], "images": [str(ws / "not_an_image.png")]}])
    err = _error(capsys, _flags(ws, data="corrupt.jsonl"))
    assert "row 0: image 0" in err and "UnidentifiedImageError" in err

    _write(ws / "text_prompts.jsonl", [{**rows[0], "prompt": "12 7 3"}])
    assert "must be a list of chat messages" in _error(capsys, _flags(ws, data="text_prompts.jsonl"))

    _write(ws / "numbers.jsonl", [{**rows[0], "images": [1, 2]}])
    assert "'images' column must hold image paths or images" in _error(capsys, _flags(ws, data="numbers.jsonl"))

    # images count at their tokens: 8 text tokens + 2 x (2 + 24 image tokens) per 128 x 192 screenshot
    big = ws / "big.png"
    screenshots(1, height=128, width=192)[0].save(big)
    _write(ws / "long.jsonl", [rows[0], {**rows[1], "images": [str(big)] * 5}])
    err = _error(capsys, _flags(ws, data="long.jsonl"))
    assert "prompt 1 (the longest) has 137 tokens" in err and f"max_position_embeddings={POSITIONS}" in err
    assert "each image counts at its tokens" in err

    tiny_model("qwen3", dtype=torch.float32).save_pretrained(ws / "text_model")  # a text model: no images
    token_id_tokenizer(97, eos_token_id=1).save_pretrained(ws / "text_model")
    err = _error(capsys, _flags(ws, model="text_model"))
    assert "'images' column" in err and "model_type 'qwen3'" in err and "runs no images" in err


def test_one_image_column_and_parquet_images_are_read_as_trl_reads_them(vlm_workspace):
    """`image` (one per row, None: a text row) from JSONL paths, and `images` stored in a
    Parquet file as `datasets.Image` bytes: checked and measured, then PIL images in the rows."""
    from longstraw import grpo_cli

    ws = vlm_workspace
    rows = [json.loads(line) for line in (ws / "data.jsonl").read_text().splitlines()]
    _write(ws / "one.jsonl", [{"prompt": rows[0]["prompt"], "image": rows[0]["images"][0]},
                              {"prompt": rows[1]["prompt"], "image": None}])
    checked = grpo_cli.check_inputs(*grpo_cli.parse(_flags(ws, data="one.jsonl")[1:])[:4])
    assert checked.longest_prompt == 2 + 8 + 3 + 3  # "12 7 3": one 64 x 96 screenshot, 6 tokens between start and end
    assert checked.train_dataset[0]["image"].size == (96, 64) and checked.train_dataset[1]["image"] is None

    datasets = pytest.importorskip("datasets")
    from PIL import Image

    pil = [[Image.open(path).convert("RGB") for path in r["images"]] for r in rows]  # PIL images: stored as bytes
    datasets.Dataset.from_dict({"prompt": [r["prompt"] for r in rows], "images": pil}).to_parquet(ws / "shots.parquet")
    for shot in ws.glob("shot*.png"):
        shot.unlink()  # the Parquet file holds the images' bytes
    checked = grpo_cli.check_inputs(*grpo_cli.parse(_flags(ws, data="shots.parquet")[1:])[:4])
    assert checked.longest_prompt == 2 + 2 * 8 + 3 + 3
    assert [image.size for image in checked.train_dataset[1]["images"]] == [(96, 64), (96, 64)]
