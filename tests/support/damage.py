"""Damaging a disk-tier block file the ways a disk or a person can: the tests that check a
damaged file is a miss (never wrong bytes) share these."""

from __future__ import annotations

import os
from pathlib import Path

#: flip: one payload bit; truncate: the first 4 KiB only; swap: another block's whole, valid
#: file under this key's name; garbage: random bytes of the same length.
DAMAGES = ("flip", "truncate", "swap", "garbage")


def damage_file(path: Path, damage: str, other: Path | None = None) -> None:
    """Damage the block file at ``path``; ``other``: the file a ``swap`` copies in."""
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[-3] ^= 0x01
        path.write_bytes(raw)
    elif damage == "truncate":
        path.write_bytes(raw[:4096])
    elif damage == "swap":
        if other is None:
            raise ValueError("a swap needs the other block's file")
        path.write_bytes(other.read_bytes())
    elif damage == "garbage":
        path.write_bytes(os.urandom(len(raw)))
    else:
        raise ValueError(f"damage must be one of {DAMAGES}, got {damage!r}")
