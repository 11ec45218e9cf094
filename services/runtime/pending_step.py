"""A step program's result that the device may still be computing: launched now, read later.

The target's decode ahead (target/decode_ahead.py) launches a step before anyone asks for it and reads the result
when the call that wants it comes. On a GPU the result lands, by a non-blocking copy, in a page-locked host buffer
and an event marks when it is there; `result` waits for that event only. Elsewhere (the CPU) the step ran to the end
when it was launched and its result is simply kept.
"""

import numpy as np
import torch


class PendingStep:
    def __init__(self, result: torch.Tensor | np.ndarray | None, event: "torch.cuda.Event | None" = None):
        """`result`: the host buffer the step's packed result is copied into (None: a rank that does not decide);
        `event`: recorded on the step's stream after that copy (None: the result is already there)."""
        self._result = result
        self._event = event
        self._copy: np.ndarray | None = None

    def result(self) -> np.ndarray | None:
        """The packed result, waiting for the device if it is not there yet. A copy of the host buffer: a graph's
        buffer is overwritten by its next replay, and a result may be read after other steps ran."""
        if self._copy is None and self._result is not None:
            if self._event is not None:
                self._event.synchronize()
            self._copy = np.array(self._result.numpy() if isinstance(self._result, torch.Tensor) else self._result)
        return self._copy
