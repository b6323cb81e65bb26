"""What `bench comm` reads from its command line: the collectives it sweeps, message sizes as nccl-tests
spells them (64K, 1K-256M) and dtypes by name. Pure text, so that the parser needs no torch."""

from __future__ import annotations

import re

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "sendrecv")
DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "int8", "uint8")
"""Each is torch's attribute of that name (sweep.py's DTYPES)."""
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp64": "float64", "double": "float64",
                 "fp16": "float16", "half": "float16", "bf16": "bfloat16", "int": "int32", "long": "int64"}


_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20, "MIB": 2**20,
          "G": 2**30, "GB": 2**30, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'64K' -> 65536. K, M, G are binary (KiB, MiB, GiB), as in nccl-tests' -b/-e flags."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 512, 1K, 64K, 16M, 1G)")
    value = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if value < 1 or value != int(value):
        raise ValueError(f"not a whole number of bytes: {text!r}")
    return int(value)


def parse_sizes(text: str) -> list[int]:
    """'1K,64K,16M' -> those sizes; '1K-256M' -> every power of two from 1 KiB to 256 MiB; mixes allowed."""
    sizes: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo_text, hi_text = part.split("-", 1)
            lo, hi = parse_size(lo_text), parse_size(hi_text)
            if lo > hi:
                raise ValueError(f"empty size range {part!r}: {lo} > {hi}")
            s = lo
            while s <= hi:
                sizes.append(s)
                s *= 2
        else:
            sizes.append(parse_size(part))
    if not sizes:
        raise ValueError(f"no sizes in {text!r}")
    return sorted(set(sizes))


def format_size(nbytes: int) -> str:
    """65536 -> '64 KiB'; sizes that are not whole units keep more digits."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:g} {unit}" if value == int(value) else f"{value:.2f} {unit}"
    return f"{nbytes} B"


def parse_dtype(name: str) -> str:
    key = DTYPE_ALIASES.get(name.lower(), name.lower())
    if key not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {', '.join(DTYPE_NAMES)}")
    return key
