"""A checkpoint's processor as LongStraw loads it: images and text, never the video processor.

HF's `AutoProcessor` gives a Qwen3.5 / 3.6 checkpoint a `Qwen3VLProcessor`: an image
processor, a tokenizer and a video processor. HF's video processors need torchvision
(`AutoProcessor` fails without it), and LongStraw refuses videos anyway (`models/vision.py`:
pass video frames as images). So for those checkpoints `load_processor` builds
`ImagesProcessor`: HF's own `Qwen3VLProcessor` code over the checkpoint's image processor
(`AutoImageProcessor`, the PIL one without torchvision) and its tokenizer, and no video
processor. Saved, it writes `processor_class: Qwen3VLProcessor`, as a real checkpoint has.

The tokenizer (`load_tokenizer`): `AutoTokenizer`, except where `tokenizer_config.json`
names a generic class (`TokenizersBackend`, `PreTrainedTokenizerFast`: "tokenizer.json as
saved"). For some model types (qwen3_5 among them) `AutoTokenizer` swaps the named class
for the family's own (`Qwen3_5Tokenizer`, which rebuilds a byte-level BPE from the vocab),
which breaks a tokenizer made for the checkpoint (the tiny VLM's word-level one). A real
Qwen3.5 checkpoint names `Qwen2Tokenizer` and loads as `AutoTokenizer` loads it.
"""

from __future__ import annotations

from transformers import AutoConfig, AutoImageProcessor, AutoProcessor, AutoTokenizer, Qwen3VLProcessor
from transformers.models.auto.tokenization_auto import get_tokenizer_config
from transformers.tokenization_utils_tokenizers import TokenizersBackend

IMAGES_PROCESSOR_TYPES = ("qwen3_5", "qwen3_5_moe")
"""Model types whose processor is loaded as `ImagesProcessor` (`models/vision.IMAGE_FAMILIES`)."""

GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")
"""`tokenizer_class` names that mean "the saved tokenizer.json, as it is"."""


class ImagesProcessor(Qwen3VLProcessor):
    """HF's `Qwen3VLProcessor` without its video processor (module doc). Images, text,
    the chat template and `mm_token_type_ids` are `Qwen3VLProcessor`'s own code; HF's
    `ProcessorMixin` takes its parts from this signature (no `video_processor`)."""

    SAVED_AS = "Qwen3VLProcessor"

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    def to_dict(self) -> dict:
        """`processor_config.json`'s dict, naming HF's class (a checkpoint loads without LongStraw)."""
        return {**super().to_dict(), "processor_class": self.SAVED_AS}


def load_tokenizer(name: str, **kwargs):
    """The checkpoint's tokenizer: its saved tokenizer.json where `tokenizer_config.json`
    names a generic class, else `AutoTokenizer` (module doc)."""
    declared = get_tokenizer_config(name, revision=kwargs.get("revision")).get("tokenizer_class")
    if declared in GENERIC_TOKENIZERS:
        return TokenizersBackend.from_pretrained(name, **kwargs)
    return AutoTokenizer.from_pretrained(name, **kwargs)


def load_processor(name: str, *, revision: str | None = None, trust_remote_code: bool = False, **kwargs):
    """`processing_class` for the checkpoint `name`: `ImagesProcessor` for a Qwen3.5 / 3.6
    VLM, the tokenizer for a text model, `AutoProcessor` for any other (module doc).

    Args:
        name: a local folder or a hub id.
        kwargs: the processor's options (TRL's `padding_side="left"`, `truncation_side`).
    """
    common = dict(revision=revision, trust_remote_code=trust_remote_code)
    config = AutoConfig.from_pretrained(name, **common)
    model_type = getattr(config, "model_type", None)
    if model_type in IMAGES_PROCESSOR_TYPES:
        tokenizer = load_tokenizer(name, **common, **kwargs)
        images = AutoImageProcessor.from_pretrained(name, **common)
        return ImagesProcessor(image_processor=images, tokenizer=tokenizer,
                               chat_template=getattr(tokenizer, "chat_template", None))
    if getattr(config, "vision_config", None) is None:
        return load_tokenizer(name, **common, **kwargs)
    return AutoProcessor.from_pretrained(name, **common, **kwargs)
