"""The Triton kernel behind ``kvstore.client.device_checksum`` (imported only where Triton is).

One program per payload: XXH3-64's 8 accumulators over the payload's 1 KiB blocks in order (a
block's 16 stripes summed at once, then the scramble), the last partial block's stripes, and
the last stripe; the merge runs on the host. Words are int64 in memory and uint64 here, where
multiplication wraps and shifts are logical, as the specification's arithmetic.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def xxh3_accumulators(words_ptr, starts_ptr, out_ptr, table_ptr, num_blocks, last_stripes,
                      last_word):
    pid = tl.program_id(0)
    start = tl.load(starts_ptr + pid)
    stripe = tl.arange(0, 16)[:, None]
    lane = tl.arange(0, 8)[None, :]
    lanes = tl.arange(0, 8)
    offs = stripe * 8 + lane  # word j of stripe s
    swapped = stripe * 8 + (lane ^ 1)  # acc[i ^ 1] += word i  <=>  acc[j] += word j ^ 1
    keys = tl.load(table_ptr + stripe + lane).to(tl.uint64, bitcast=True)
    scramble = tl.load(table_ptr + 23 + lanes).to(tl.uint64, bitcast=True)
    last_keys = tl.load(table_ptr + 31 + lanes).to(tl.uint64, bitcast=True)
    acc = tl.load(table_ptr + 39 + lanes).to(tl.uint64, bitcast=True)
    for b in range(0, num_blocks):
        base = words_ptr + start + b * 128
        data = tl.load(base + offs).to(tl.uint64, bitcast=True)
        other = tl.load(base + swapped).to(tl.uint64, bitcast=True)
        mixed = data ^ keys
        acc += tl.sum((mixed & 0xFFFFFFFF) * (mixed >> 32) + other, axis=0)
        acc = ((acc ^ (acc >> 47)) ^ scramble) * 0x9E3779B1
    base = words_ptr + start + num_blocks * 128
    used = stripe < last_stripes
    data = tl.load(base + offs, mask=used, other=0).to(tl.uint64, bitcast=True)
    other = tl.load(base + swapped, mask=used, other=0).to(tl.uint64, bitcast=True)
    mixed = data ^ keys
    acc += tl.sum(tl.where(used, (mixed & 0xFFFFFFFF) * (mixed >> 32) + other, 0), axis=0)
    data = tl.load(words_ptr + start + last_word + lanes).to(tl.uint64, bitcast=True)
    other = tl.load(words_ptr + start + last_word + (lanes ^ 1)).to(tl.uint64, bitcast=True)
    mixed = data ^ last_keys
    acc += (mixed & 0xFFFFFFFF) * (mixed >> 32) + other
    tl.store(out_ptr + pid * 8 + lanes, acc.to(tl.int64, bitcast=True))
