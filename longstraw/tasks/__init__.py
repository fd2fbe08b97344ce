"""Long-context tasks with verifiable rewards, generated from a seed (no downloads)."""

from .kv_recall import Item, KVRecall, Vocab, exact_match, reward
from .tool_lookup import LookupItem, ToolLookup

__all__ = ["KVRecall", "Item", "Vocab", "reward", "exact_match", "ToolLookup", "LookupItem"]
