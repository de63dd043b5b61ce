"""Slurm host lists and numbers as Slurm reads them (pure: the slurmctld
side and the coordinator both read them)."""
from __future__ import annotations

import re


def expand_hostlist(text: str) -> list[str]:
    """Slurm host lists: "n[1-3,7],login1" -> n1 n2 n3 n7 login1 (zero padding kept)."""
    names: list[str] = []
    for part in re.findall(r"[^,\[]*(?:\[[^\]]*\][^,\[]*)*", text):
        if not part:
            continue
        match = re.match(r"^(.*?)\[([^\]]*)\](.*)$", part)
        if not match:
            names.append(part)
            continue
        prefix, ranges, rest = match.groups()
        for item in ranges.split(","):
            lo, _, hi = item.partition("-")
            width = len(lo) if lo.startswith("0") else 0
            if not ascii_digits(lo) or (hi and not ascii_digits(hi)):
                continue
            for i in range(int(lo), int(hi or lo) + 1):
                names += [f"{prefix}{i:0{width}d}{tail}" for tail in expand_hostlist(rest) or [""]]
    return names


def ascii_digits(value: str) -> bool:
    """ASCII digits only, as Slurm reads numbers: str.isdigit() is true for
    "²" (which int() refuses) and for other scripts' digits (which int()
    reads): neither is a number Slurm would read."""
    return value.isascii() and value.isdigit()
