"""What cannot run inside a CUDA-graph capture (``torch.cuda.graph`` around a ``capturable=True``
step): a call that reads a device value on the host. The operators that need one call
:func:`refuse_in_capture` first, so a capture that reaches them ends cleanly with a reason instead
of invalidating the CUDA context."""

from __future__ import annotations

import torch


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (work is recorded, not run)."""
    return not torch.compiler.is_compiling() and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def refuse_in_capture(what: str) -> None:
    """Raise before ``what`` (a decomposition, or an iteration sized on the host) runs inside a
    CUDA-graph capture: torch's ``linalg.eigh``/``svd`` read their error codes on the host (there is
    no ``eigh_ex``/``svd_ex``), which a capture forbids, and a failed capture leaves the CUDA context
    unusable. Raised first, the capture ends cleanly with nothing run."""
    if capturing():
        raise RuntimeError(
            f"geomopt: this step needs {what}, which cannot run inside a CUDA-graph "
            "capture (torch reads its result or error code on the host). Capture the step of a spec whose "
            "rules need none (no spectral constraint, a polynomial approx), or run capturable=True without a "
            "CUDA graph (eagerly, or under torch.compile)")
