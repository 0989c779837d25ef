"""Scratch memory of a step, shared by its buckets.

A bucket's step needs a few transient tensors as large as the bucket (Nesterov's look-ahead u in
the forward op's dtype, the elementwise map's output of a flat chunk). Where buckets run one after
another (one process, no deferred finiteness test), one buffer per (slot, device, dtype) serves
them all: a bucket takes a view of its first ``numel`` entries and is done with it before the next
bucket takes it. So a step needs what the algorithm keeps (its state) plus scratch bounded by the
largest bucket, not a copy per tensor. The optimizer releases it at the end of each step
(:meth:`Workspace.release`; not a capturable one, whose captured steps replay into it): between
steps it holds its state only, as torch's optimizers. Measured (issue 30): no step-time cost, the
next step's buffers come from the allocator's free lists.
"""

from __future__ import annotations

import math

import torch


class Workspace:
    """One growable flat buffer per (slot, device, dtype); :meth:`take` returns a view of it.

    A caller may hold at most one view per slot at a time: the next :meth:`take` of the slot
    overwrites it (and may reallocate it, when it needs more than the buffer has)."""

    def __init__(self):
        self._buffers: dict = {}

    def take(self, slot: str, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        n = math.prod(shape)
        key = (slot, torch.device(device), dtype)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < n:
            self._buffers.pop(key, None)  # freed before the larger one is made
            buf = self._buffers[key] = torch.empty(n, dtype=dtype, device=device)
        return buf[:n].view(shape)

    def release(self) -> None:
        """Drop every buffer (the end of a step): between steps the optimizer holds its state and
        nothing of the step's scratch, as torch's optimizers, which make their temporaries per step."""
        self._buffers.clear()

    def drop(self, prefixes: tuple) -> None:
        """Drop the buffers of the slots whose names start with one of ``prefixes`` (a part of the
        step done with them)."""
        for key in [k for k in self._buffers if k[0].startswith(prefixes)]:
            del self._buffers[key]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())
