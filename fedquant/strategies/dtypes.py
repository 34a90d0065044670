"""The aggregate's integer and bool entries back in the dtype the server sent.

Flower's strategies average every entry like a float: an int64 counter or a bool mask comes back
as float64. Restored (integers rounded, bools by majority of weight), the admission rules on
non-float entries still apply in the next round and the model keeps its types.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord


def restore_dtypes(arrays: ArrayRecord | None, dtypes: Mapping[str, np.dtype]) -> ArrayRecord | None:
    """The aggregate with integer and bool entries back in the dtype sent (rounded, clipped to range)."""
    if arrays is None:
        return None
    out: dict[str, Array] = {}
    changed = False
    for name, array in arrays.items():
        want = dtypes.get(name)
        if want is None or want.kind not in "iub" or array.dtype == str(want):
            out[name] = array
            continue
        value = array.numpy()
        if want.kind == "b":
            restored = value >= 0.5
        else:
            info = np.iinfo(want)
            high = np.nextafter(np.float64(info.max), 0.0)  # float(int64 max) rounds up, out of range
            rounded = np.rint(np.nan_to_num(value.astype(np.float64), posinf=high, neginf=info.min))
            restored = np.clip(rounded, info.min, high).astype(want)
        out[name] = Array(np.require(restored, requirements="C"))
        changed = True
    return ArrayRecord(out) if changed else arrays
