"""The caller-owned CPU buffers that ``ClusterStore.batch_get_into`` fills: one row per block."""

from __future__ import annotations

import numpy as np
import torch

from kvstore.block import block_nbytes
from kvstore.keys import Namespace


def new_block_buffer(namespace: Namespace, num_blocks: int) -> torch.Tensor:
    """A ``[num_blocks, block_nbytes]`` uint8 CPU tensor to pass to ``batch_get_into``."""
    return new_rows(num_blocks, block_nbytes(namespace))


def new_rows(rows: int, nbytes: int) -> torch.Tensor:
    """A ``[rows, nbytes]`` uint8 CPU tensor allocated by numpy, which asks the kernel for
    transparent huge pages on large arrays: first touch then faults 2 MiB at a time instead of
    4 KiB, so the buffer fills faster than a ``torch.empty`` one, fresh or reused (fewer page
    faults and TLB misses)."""
    return torch.from_numpy(np.empty((rows, nbytes), dtype=np.uint8))


def check_block_buffer(out: torch.Tensor, num_blocks: int, nbytes: int) -> None:
    """Reject an ``out`` buffer that cannot hold the batch, saying what shape it needs."""
    if not isinstance(out, torch.Tensor) or out.dtype != torch.uint8 or out.dim() != 2 \
            or out.device.type != "cpu" or not out.is_contiguous():
        raise ValueError("out must be a contiguous 2-D uint8 CPU tensor "
                         f"[num_blocks, {nbytes}], e.g. torch.empty(({num_blocks}, {nbytes}), "
                         "dtype=torch.uint8)")
    if out.shape[0] < num_blocks or out.shape[1] < nbytes:
        raise ValueError(f"out has shape {tuple(out.shape)}; this batch needs at least "
                         f"[{num_blocks}, {nbytes}]")
