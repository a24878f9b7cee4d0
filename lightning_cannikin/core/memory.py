"""Peak device memory as a function of the local batch, and the largest batch a device can hold.

``peak(b) = m0 + m1 * b`` fitted from (local batch, peak allocated bytes) samples: activations grow linearly with the
batch on top of the parameters, gradients and optimizer state. The cap keeps the prediction within ``headroom`` of
the capacity it is given (on CUDA the memory this process can use: free on the device plus what it holds, see
``training/measurement/device_memory.py``), for allocator fragmentation and what the allocator does not count.

Pure: numpy only (no torch, no Lightning).
"""

from __future__ import annotations

import math

import numpy as np

from lightning_cannikin.core.sample_window import BatchSizeWindow


class MemoryFitter:
    """``(batch_size, peak_bytes)`` samples of one device -> the largest local batch that fits.

    Args:
        max_samples: samples kept. The oldest are dropped, except a few of the previous batch size, so that the fit
            (and the cap) survive any number of steps at one plan.

    """

    def __init__(self, max_samples: int = 256) -> None:
        self._window = BatchSizeWindow(max_samples)

    def add(self, batch_size: int, peak_bytes: float) -> None:
        """Record one step's peak; non-finite or non-positive values are ignored."""
        if batch_size >= 1 and math.isfinite(peak_bytes) and peak_bytes > 0:
            self._window.append(int(batch_size), float(peak_bytes))

    def fit(self) -> tuple[float, float] | None:
        """``(m0, m1)`` in bytes and bytes per sample, or ``None`` before two distinct batch sizes were seen.

        Uses the largest peak seen at each batch size: memory is nearly deterministic, and an underestimate is what
        runs a device out of memory.
        """
        peaks: dict[int, float] = {}
        for batch, peak in self._window.pairs():
            peaks[batch] = max(peak, peaks.get(batch, 0.0))
        if len(peaks) < 2:
            return None
        sizes = np.array(sorted(peaks), dtype=float)
        slope, intercept = np.polyfit(sizes, [peaks[int(b)] for b in sizes], 1)
        # a batch never frees memory: a fitted slope at or below zero is noise, so cost at least the observed spread
        return float(intercept), max(float(slope), 1.0)

    def max_batch_size(self, capacity_bytes: float, headroom: float = 0.9) -> int | None:
        """The largest batch whose predicted peak stays within ``headroom x capacity`` (``None`` before any sample).

        From one batch size ``b`` with peak ``p`` the bound is the proportional one, ``b x headroom x capacity / p``:
        the fixed part ``m0`` is not negative, so the peak grows at most in proportion to the batch. A rank is then
        never probed above what that one measurement shows is safe, before a second size gives the fit.
        """
        model = self.fit()
        if model is None:
            pairs = self._window.pairs()
            if not pairs:
                return None
            batch = pairs[-1][0]
            peak = max(p for b, p in pairs if b == batch)
            return max(0, int(batch * headroom * capacity_bytes // peak))
        m0, m1 = model
        return max(0, int((headroom * capacity_bytes - m0) // m1))

    def state_dict(self) -> dict:
        return {"samples": [list(s) for s in self._window.pairs()]}

    def load_state_dict(self, state: dict) -> None:
        self._window.clear()
        for batch, peak in state["samples"]:
            self.add(batch, peak)  # the same checks and eviction as live samples
