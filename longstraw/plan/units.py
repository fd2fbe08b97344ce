"""Memory sizes in and out of the planner: `parse_bytes` reads '96GB' / '96GiB', `human_bytes`
writes bytes for people. Torch-free (the planner's)."""

from __future__ import annotations

import re

from ..errors import ConfigError


def parse_bytes(text) -> int:
    """'96GB' -> 96e9, '96GiB' -> 96 * 2**30, '512MiB', '1.5TB', 1024 -> 1024.

    SI units (KB, MB, GB, TB) are powers of 1000; binary ones (KiB, MiB, GiB, TiB) and the
    bare letters (K, M, G, T) are powers of 1024. A bare number is bytes.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text < 0:
            raise ConfigError(f"a memory size must be >= 0, got {text!r}")
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b?|b)?\s*", str(text), flags=re.IGNORECASE)
    if not m:
        raise ConfigError(f"cannot read memory size {text!r}: write e.g. 96GB (10^9 bytes) or 96GiB (2^30 bytes)")
    value, unit = float(m.group(1)), (m.group(2) or "b").lower()
    if unit == "b":
        return int(value)
    power = "kmgt".index(unit[0]) + 1
    base = 1000 if unit.endswith("b") and not unit.endswith("ib") else 1024
    return int(round(value * base**power))


def human_bytes(n: float) -> str:
    """1234567890 -> '1.15 GiB (1.23 GB)'."""
    for unit, p in (("TiB", 4), ("GiB", 3), ("MiB", 2), ("KiB", 1)):
        if abs(n) >= 1024**p:
            return f"{n / 1024**p:,.2f} {unit} ({n / 1000**p:,.2f} {unit.replace('i', '')})"
    return f"{int(n):,} B"
