"""A model's fingerprint: config and weights, computed where the weights are.

The namespace names a model by a digest of its config and of every weight's bytes, so two
workers share blocks only when they run the same weights. Hashing the bytes on the host with
sha256 would copy every byte to the host and hash gigabytes on one core at each model load, so
the weights part is a checksum that runs on the weights' own device:

    each tensor's bytes as int16 words w, in rows of ``ROW`` words (the last row zero-padded)
    row sum = sum_i w[i] * m[i]        m: a fixed pseudo-random vector of ints in [1, 2^15)

Every product is below 2^30 and a row sum below 2^46, so the sums are exact integers in
float64 (53-bit mantissa) in any summation order: a matrix-vector product on any device gives
the same sums bitwise, on the CPU and on a GPU alike. The row sums (a few KB per GB of weights)
then go to the host and into sha256 with each tensor's name, dtype and shape. A change to any
word changes its row's sum (m[i] is non-zero), so an edited weight changes the fingerprint; it
is a fingerprint against mix-ups, not a defence against someone crafting colliding weights (a
model owner can make any model anyway).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

#: Words per row: large enough that the row sums are a tiny fraction of the weights.
ROW = 1 << 16
#: Rows per step: bounds the float64 temporary at 512 MiB whatever the tensor's size.
_ROWS_PER_STEP = 1 << 10
_SEED = 20261125

# Config fields that name where or how a model was loaded, not what it computes.
# (save_pretrained adds "architectures" to the config it saves, so it cannot count either.)
_VOLATILE_CONFIG_KEYS = ("_name_or_path", "architectures", "transformers_version",
                         "_attn_implementation", "_attn_implementation_internal", "_commit_hash",
                         "dtype", "torch_dtype")

_multipliers: dict[torch.device, torch.Tensor] = {}


def _weights(device: torch.device) -> torch.Tensor:
    """The fixed multiplier vector on ``device`` (made on the CPU: the same on every host)."""
    m = _multipliers.get(device)
    if m is None:
        gen = torch.Generator().manual_seed(_SEED)
        m = torch.randint(1, 1 << 15, (ROW,), generator=gen, dtype=torch.int64)
        m = _multipliers[device] = m.to(device=device, dtype=torch.float64)
    return m


def tensor_checksum(tensor: torch.Tensor) -> bytes:
    """The exact row sums of one tensor's bytes (see the module docstring), as bytes."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    words = flat.view(torch.int16)
    num_rows = -(-words.numel() // ROW)
    pad = num_rows * ROW - words.numel()
    m = _weights(words.device)
    sums = []
    step = _ROWS_PER_STEP * ROW
    for lo in range(0, words.numel(), step):
        part = words[lo:lo + step]
        if lo + step >= words.numel() and pad:
            part = torch.cat([part, part.new_zeros(pad)])
        sums.append(part.view(-1, ROW).to(torch.float64) @ m)
    if not sums:
        return b""
    # One copy of the sums to the host per tensor; float64 bytes of exact integers.
    return torch.cat(sums).to("cpu").numpy().tobytes()


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over every parameter and buffer: name, dtype, shape and its device checksum."""
    h = hashlib.sha256()
    state = model.state_dict()
    for name in sorted(state):
        tensor = state[name]
        h.update(name.encode())
        h.update(f"{tensor.dtype}:{tuple(tensor.shape)}".encode())
        if tensor.numel():
            h.update(tensor_checksum(tensor))
    return h.hexdigest()


def config_digest(config: Any) -> str:
    """sha256 of the config's canonical JSON, without load-time fields."""
    fields = {k: v for k, v in config.to_dict().items() if k not in _VOLATILE_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


def model_fingerprint(model: torch.nn.Module) -> str:
    """The model part of a namespace: config and weights."""
    return hashlib.sha256((config_digest(model.config) + weights_digest(model)).encode()
                          ).hexdigest()
