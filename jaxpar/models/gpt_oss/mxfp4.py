"""MXFP4, the format gpt-oss's released checkpoints store their expert weights in (OCP Microscaling
Formats v1.0): per block of 32 values along the contracted dim, one shared E8M0 scale (a uint8
exponent s, the value 2^(s - 127)) and 32 FP4 E2M1 elements, two per byte, the element of the
lower index in the low nibble. An E2M1 nibble is a sign bit then 3 bits indexing the magnitudes
0, 0.5, 1, 1.5, 2, 3, 4, 6.

On disk (transformers' names): `<proj>_blocks` uint8 [E, rows, blocks, 16] and `<proj>_scales`
uint8 [E, rows, blocks], rows being the projection's output features; dequantized they are the
projection [E, rows, blocks · 32] = [E, out, in], which transformers transposes into its
in-memory [E, in, out].
"""

from __future__ import annotations

import numpy as np

MAGNITUDES = np.asarray([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
VALUES = np.concatenate([MAGNITUDES, -MAGNITUDES])  # nibble n: sign n >> 3, magnitude n & 7


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 [..., rows, blocks · 32] from uint8 `blocks` [..., rows, blocks, 16] and `scales` [..., rows, blocks]."""
    blocks, scales = np.asarray(blocks).astype(np.uint8), np.asarray(scales).astype(np.uint8)
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not pair "
                         "([..., blocks, 16] with [..., blocks])")
    pairs = np.stack([VALUES[blocks & 0x0F], VALUES[blocks >> 4]], axis=-1)  # [..., blocks, 16, 2]
    values = pairs.reshape(*blocks.shape[:-1], 32)
    # 2^(s - 127) is exact in float32 for every s but 0 and 255 (subnormal or past the range);
    # ldexp keeps those exact too, as far as float32 holds them.
    out = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return out.reshape(*blocks.shape[:-2], blocks.shape[-2] * 32)
