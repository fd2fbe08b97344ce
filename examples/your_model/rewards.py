"""The reward of examples/your_model: TRL's reward signature, one float per completion.

`answer` is the JSONL's column of that name (TRL passes every extra column as a keyword).
"""

VALUES = range(2100, 2116)  # the answer tokens the prompts use (make_files.py)


def score(first: int | None, want: int) -> float:
    """1 for the asked key's value, 0.1 for another value token (where answers live), else 0."""
    return 1.0 if first == want else 0.1 if first in VALUES else 0.0


def first_token_is_answer(completion_ids, answer, **kwargs):
    """`score` of each completion's first token."""
    return [score(ids[0] if ids else None, want) for ids, want in zip(completion_ids, answer)]
