"""`longstraw grpo` on an image dataset: TRL's `image` / `images` columns, checked before any model loads.

A local JSONL / JSON / CSV file holds images as paths (absolute, or relative to where the
command runs), one per row in `image` or a list per row in `images`; a Parquet file or a
`save_to_disk` folder written by `datasets` may hold them as `datasets.Image` already.
`image_dataset` checks every row and returns the dataset with the column cast to
`datasets.Image` (PIL images at each row's read, what TRL's VLM GRPO hands its processor):

* the model is a VLM whose images LongStraw runs (Qwen3.5 / 3.6, `models/vision.py`), and
  the processor has an image processor;
* the prompts are chat messages (TRL inserts the images into the first user message);
* every image of every row opens (`PIL.Image.open(...).load()`), else the row, the image
  and the reason;
* each row's length is the processor's, images expanded to their tokens (for the check
  against the model's positions).
"""

from __future__ import annotations

import io

import datasets
from PIL import Image
from trl.data_utils import is_conversational, prepare_multimodal_messages

from longstraw.errors import ConfigError
from longstraw.models.vision import IMAGE_FAMILIES

IMAGE_COLUMNS = ("images", "image")
"""TRL's image columns: a list of images per row, or one image per row (TRL reads `images` first)."""


def image_column(train) -> str | None:
    """The dataset's image column (TRL's order), or None for a text dataset."""
    return next((c for c in IMAGE_COLUMNS if c in (train.column_names or [])), None)


def _cast(train, column: str, decode: bool):
    feature = datasets.Image(decode=decode)
    try:
        return train.cast_column(column, datasets.List(feature) if column == "images" else feature)
    except Exception as exc:  # pyarrow's cast errors: the column holds something else
        raise ConfigError(f"the dataset's {column!r} column must hold image paths or images "
                          f"({'a list per row' if column == 'images' else 'one per row'}); "
                          f"casting it failed ({type(exc).__name__}: {exc})") from None


def _open(image: dict, row: int, k: int) -> Image.Image:
    """The decoded image of an undecoded `datasets.Image` value {"path", "bytes"}."""
    where = image.get("path") or "bytes"
    try:
        opened = Image.open(io.BytesIO(image["bytes"]) if image.get("bytes") else image["path"])
        opened.load()
    except Exception as exc:  # PIL raises OSError, UnidentifiedImageError, ValueError, ...
        raise ConfigError(f"row {row}: image {k} ({where}) does not open ({type(exc).__name__}: {exc}); fix the path "
                          "(absolute, or relative to where the command runs) or the file, or drop the row") from None
    return opened


def check_model(column: str, processing_class, model_type) -> None:
    """A `ConfigError` when the dataset has images and the model or its processor runs none."""
    if model_type not in IMAGE_FAMILIES:
        raise ConfigError(f"the dataset has an {column!r} column, but the model (model_type {model_type!r}) runs no "
                          f"images here: pass a {' / '.join(IMAGE_FAMILIES)} vision-language checkpoint (Qwen3.5 / "
                          "3.6), or drop the column")
    if getattr(processing_class, "image_processor", None) is None:
        raise ConfigError(f"the dataset has an {column!r} column, but the checkpoint's processor has no image "
                          "processor: save the model's processor (its preprocessor config) into the checkpoint folder")


def image_dataset(train, column: str, processing_class, model_type, chat_template_kwargs=None):
    """(the dataset with `column` as `datasets.Image`, each row's prompt length in tokens),
    after the checks of the module doc; a `ConfigError` names what to change."""
    check_model(column, processing_class, model_type)
    lengths = []
    for row, example in enumerate(_cast(train, column, decode=False)):
        if not is_conversational(example):
            raise ConfigError(f"row {row}: a prompt with images must be a list of chat messages (TRL's rule: "
                              "[{'role': 'user', 'content': '...'}]), not text with a chat template applied")
        value = example[column]
        images = [] if value is None else [value] if column == "image" else list(value)
        opened = [_open(image, row, k) for k, image in enumerate(images) if image is not None]
        messages = prepare_multimodal_messages(example["prompt"], images=opened)  # as TRL's trainer
        ids = processing_class.apply_chat_template([messages], add_generation_prompt=True, tokenize=True,
                                                   return_dict=True, **dict(chat_template_kwargs or {}))["input_ids"]
        lengths.append(len(ids[0]))
    return _cast(train, column, decode=True), lengths
