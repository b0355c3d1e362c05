"""Arrow arrays as numpy arrays, without pyarrow's conversion where a view of the data buffer is the answer.

`Array.to_numpy` goes through pyarrow's pandas conversion, which imports pandas (~0.2 s) even for a zero-copy
view: that was a tenth of a short run, spent after its cache was published (its length report), and the same in
a trainer's first batch. A cache's columns are fixed-width integers with no nulls, which are views of their
buffers; anything else is left to pyarrow.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def _dtype(kind: pa.DataType) -> np.dtype | None:
    if pa.types.is_signed_integer(kind):
        return np.dtype(f"i{kind.bit_width // 8}")
    if pa.types.is_unsigned_integer(kind):
        return np.dtype(f"u{kind.bit_width // 8}")
    if pa.types.is_floating(kind) and kind.bit_width in (32, 64):
        return np.dtype(f"f{kind.bit_width // 8}")
    return None


def numpy_of(array: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """The values of `array`: a read-only view of its buffer for integers or floats with no nulls, else what
    `to_numpy(zero_copy_only=False)` gives (a chunked array's chunks each so, then concatenated)."""
    if isinstance(array, pa.ChunkedArray):
        if not array.num_chunks:
            return array.to_numpy()
        views = [numpy_of(chunk) for chunk in array.chunks]
        return views[0] if len(views) == 1 else np.concatenate(views)
    dtype = _dtype(array.type)
    if dtype is None or array.null_count:
        return array.to_numpy(zero_copy_only=False)
    return np.frombuffer(array.buffers()[1], dtype=dtype, count=len(array), offset=array.offset * dtype.itemsize)
