"""A tool-calling chat tokenizer for models built in code (nothing can be downloaded).

TRL's tool loop (`GRPOTrainer._tool_call_loop`, TRL 1.16) needs a tokenizer whose chat
template renders user -> assistant (with tool calls) -> tool turns, is prefix-preserving
(TRL cuts the tool turn's ids out of two renderings), and has a `response_template` from
which `parse_response` reads the tool calls out of generated ids. `tool_chat_tokenizer`
builds one from a word-level vocabulary:

    ids 0..8    <pad> <eos> <user> <a> <tool> </tool> <tool_call> </tool_call> <unk>
    next        one word per call: {"name":"lookup","arguments":{"key":"<v>"}}, v < num_values
    the rest    the decimal numbers "0", "1", ... (prompt, tool result and answer words)

    rendering   <user> 12 7 <eos> <a> <tool_call> {"name":...} </tool_call> <eos> <tool> 31 </tool> <a>

`<eos>` ends every turn (the model's eos); the generation prompt is `<a>`. A tool call is
three tokens, `<tool_call> CALL </tool_call>`, so a tiny model can emit one.

`token_id_tokenizer` is the plain one (no chat template): the decimal ids themselves.
"""

from __future__ import annotations

import json

from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from ..errors import ConfigError

SPECIAL_TOKENS = ("<pad>", "<eos>", "<user>", "<a>", "<tool>", "</tool>", "<tool_call>", "</tool_call>", "<unk>")

CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}{{ '<user> ' + m['content'] + ' <eos> ' }}"
    "{%- elif m['role'] == 'assistant' -%}{{ '<a> ' }}{%- if m['content'] -%}{{ m['content'] + ' ' }}{%- endif -%}"
    "{%- for c in (m['tool_calls'] if m['tool_calls'] is defined and m['tool_calls'] else []) -%}"
    "{{ '<tool_call> ' + (c['function'] | tojson(separators=(',', ':'))) + ' </tool_call> ' }}{%- endfor -%}"
    "{{ '<eos> ' }}"
    "{%- elif m['role'] == 'tool' -%}{{ '<tool> ' + m['content'] + ' </tool> ' }}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<a>' }}{%- endif -%}"
)
"""Prefix-preserving: a message renders the same whatever follows it."""

RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<a>",
    "fields": {
        "tool_calls": {"open": "<tool_call>", "close_pattern": r"</tool_call>\s*", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"<eos>\s*", "content": "text"},
    },
}
"""transformers' `response_template` (>= 5.13) for `CHAT_TEMPLATE`, in the style of TRL's `qwen3_template`."""


def call_word(tool: str, argument: str, value) -> str:
    """The one vocabulary word of the call `tool(argument=str(value))`."""
    return json.dumps({"name": tool, "arguments": {argument: str(value)}}, separators=(",", ":"))


def tool_chat_tokenizer(vocab_size: int, *, tool: str = "lookup", argument: str = "key", num_values: int = 10):
    """A `PreTrainedTokenizerFast` with `CHAT_TEMPLATE` and `RESPONSE_TEMPLATE` (module doc)
    over `vocab_size` ids: pass it as `processing_class` with `tools=[...]`.

    Args:
        vocab_size: the model's vocabulary size (> 9 + num_values: some numbers must fit).
        tool, argument: the one tool the call words name, and its string argument.
        num_values: call words for the argument values "0" .. str(num_values - 1).
    """
    words = list(SPECIAL_TOKENS) + [call_word(tool, argument, v) for v in range(num_values)]
    if vocab_size <= len(words):
        raise ConfigError(f"tool_chat_tokenizer: vocab_size={vocab_size} leaves no room for number words after "
                         f"{len(words)} special and call words; raise vocab_size or lower num_values")
    words += [str(n) for n in range(vocab_size - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
                                        padding_side="left")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.response_template = RESPONSE_TEMPLATE
    return tokenizer


def token_id_tokenizer(vocab_size: int, *, eos_token_id: int = 0, pad_token_id: int | None = None):
    """A tokenizer whose tokens are the decimal ids themselves ("12 7 3" <-> [12, 7, 3]),
    for models built in code (nothing to download): pass it as `processing_class`."""
    vocab = {str(i): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=str(eos_token_id)))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    pad = eos_token_id if pad_token_id is None else pad_token_id

    def whole(i):  # a special token matches whole words only: "1" as eos must not split "2100" into 2 1 00
        return AddedToken(str(i), single_word=True, special=True)

    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=whole(eos_token_id), pad_token=whole(pad),
                                   padding_side="left")
