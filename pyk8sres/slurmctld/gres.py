"""Slurm TRES-per-X strings: parse, edit, format.

22.05 writes `gres:gpu:2,gres:k8scpu:3`; 23.02 and later `gres/gpu:2,...`.
We edit only our own two names and leave every other entry as it was.
"""
from __future__ import annotations

import re

from .. import GRES_CPU, GRES_MEMORY

OURS = (GRES_CPU, GRES_MEMORY)
# Slurm's count suffixes (gres.c): binary multiples.
_SUFFIX = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "p": 1 << 50}
_COUNT = re.compile(r"^([0-9]+)([kmgtp]?)$", re.I)   # ASCII digits, as Slurm reads them
# Slurm keeps GRES counts in uint64; anything near that is a typo or an attack.
MAX_COUNT = 1 << 62


class GresError(ValueError):
    pass


class Entry:
    """One entry of a TRES string.  (A plain class: compiled by mypyc it is
    built natively; a dataclass's generated __init__ would run interpreted.)"""

    def __init__(self, text: str, name: str | None, count: int | None) -> None:
        self.text = text    # the entry as written, to keep foreign entries intact
        self.name = name    # GRES name, None for a non-GRES TRES (e.g. "cpu:2")
        self.count = count  # None when the entry has no parsable count

    def __repr__(self) -> str:
        return f"Entry({self.text!r}, {self.name!r}, {self.count!r})"


def parse_count(text: str) -> int | None:
    match = _COUNT.match(text)
    if not match:
        return None
    return int(match.group(1)) * _SUFFIX[match.group(2).lower()]


def parse(tres: str | None) -> list[Entry]:
    """Entries of a TRES string; raises GresError for malformed k8s entries."""
    if not tres:
        return []
    entries = []
    for text in tres.replace(";", ",").split(","):
        text = text.strip()
        if not text:
            continue
        body = text
        for prefix in ("gres:", "gres/"):
            if body.startswith(prefix):
                body = body[len(prefix):]
                break
        else:
            entries.append(Entry(text, None, None))
            continue
        # name[:type]:count, or TRES-style name[:type]=count (24.11's sbatch
        # sends --gpus-per-task=1 as gres/gpu=1, and a:1 as gres/gpu:a=1)
        body_name, tres_style, tres_count = body.partition("=")
        fields = body_name.split(":")
        name = fields[0]
        if not name:
            continue  # "gres:" alone (e.g. `scontrol update job Gres=`): nothing asked
        if tres_style:
            count, typed = parse_count(tres_count), len(fields) > 1
        else:
            count, typed = (parse_count(fields[-1]) if len(fields) > 1 else 1), len(fields) > 2
        if name in OURS:
            if typed or count is None:
                raise GresError(f"invalid GRES {body!r}: {name} takes a plain count, "
                                f"e.g. {name}:4")
            if count > MAX_COUNT:
                raise GresError(f"invalid GRES {body!r}: count too large")
        entries.append(Entry(text, name, count))
    return entries


def count_of(entries: list[Entry], name: str) -> int | None:
    """Total requested of `name` (Slurm adds repeated entries), None if absent."""
    if not entries:
        return None
    counts = [e.count or 0 for e in entries if e.name == name]
    return sum(counts) if counts else None


def entry_text(name: str, count: int, slash: bool) -> str:
    """slash: the release writes gres/NAME:N (23.11 on), else gres:NAME:N."""
    sep = "/" if slash else ":"
    return f"gres{sep}{name}:{count}"


def with_counts(entries: list[Entry], counts: dict[str, int], slash: bool) -> str:
    """Format `entries` with each name in `counts` set to exactly that count:
    one entry per name (no duplicates), foreign entries untouched."""
    texts = [e.text for e in entries if e.name not in counts]
    texts += [entry_text(name, count, slash) for name, count in counts.items()]
    return ",".join(texts)


def without(entries: list[Entry], names) -> str:
    return ",".join(e.text for e in entries if e.name not in names)
