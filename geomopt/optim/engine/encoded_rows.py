"""A batched bucket's Polyak momentum kept in a lower precision (a rule's ``state: bfloat16 | int8 |
int8-ec``), stepped in groups of whole matrices of the stack.

Decoding the bucket's momentum whole would hold a float32 copy of it through the forward op
(Newton–Schulz's iterates and the look-ahead are alive then too), and the new encoding beside it
at the commit: the step's peak would exceed the float32 state's by the momentum's float32 bytes.
Here the forward op's input u is formed group by group (:func:`~geomopt.optim.persist.state_codec.row_groups`:
at most the codec's CHUNK entries, or one matrix), each group's d decoded into one float32 scratch of a group's
size (the largest group's, reused); at the commit each group is decoded again, d⁺ = d.lerp(g, α) formed in that scratch
and encoded into new stored entries, which the bucket binds. The forward op stays batched over
the whole stack. Every op is the one :func:`~geomopt.optim.units.directions.polyak_rows` runs,
elementwise, on the same values, and the codec's blocks and rounding bits are per entry, so the
groups change no bit; a second decoding pass costs what the float32 copy's pages cost.

Without Nesterov the forward op's input is d⁺ itself, a new float32 stack in float32 state too:
it is formed group by group from the decoded groups and encoded whole at the commit."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from geomopt.optim.persist.state_codec import STORED, Codec, decode_range, row_groups, shaped
from geomopt.optim.units.directions import polyak_lerp, polyak_lookahead, polyak_lookahead_rows
from geomopt.optim.units.state_keys import CORRECTION, SCALE

KEY = "d"


class EncodedMomentum:
    """The stored entries of a bucket's momentum (``stored``: d's codes or bf16 values and its
    scales and corrections, taken out of the gathered state), the bucket's gradients ``gs`` (one
    per row) and Polyak's ``alpha`` and ``nesterov``."""

    def __init__(self, codec: Codec, stored: dict, gs: list, alpha, nesterov: bool):
        self.codec, self.stored, self.gs, self.alpha, self.nesterov = codec, stored, gs, alpha, nesterov
        self.shape = tuple(stored[KEY].shape)
        self.row = stored[KEY][0].numel()
        self.in_place = True  # the commit's d⁺: polyak_rows's put-off foreach lerp (else its lerp into a new d)

    @staticmethod
    def take(direction_form: str, codec: Codec, state: dict, gs, group: dict, ok) -> Optional["EncodedMomentum"]:
        """The bucket's momentum, its stored entries popped from the gathered ``state``, where it
        steps in groups: Polyak read row by row (``direction_form`` rows; ``group``: its α and
        Nesterov as this step reads them), d held encoded and kept so by the rule (``codec``; not a
        first step, not a tensor int8 keeps float32), not a capturable step (``ok``); else None and
        ``state`` as it was."""
        d = state.get(KEY)
        if direction_form != "rows" or ok is not None or not isinstance(gs, list) or d is None \
                or d.dtype not in STORED.values() or not codec.stored(KEY, d[0]):
            return None
        stored = {k: state.pop(k) for k in (KEY, KEY + SCALE, KEY + CORRECTION) if k in state}
        return EncodedMomentum(codec, stored, gs, group["alpha"], group["nesterov"])

    def groups(self):
        """(i, j, the float32 values of rows [i, j) of d) for each group of rows in turn, decoded
        into one scratch of the largest group's size (each group's values are gone at the next)."""
        groups = row_groups(self.shape[0], self.row)
        scratch = torch.empty(max(j - i for i, j in groups) * self.row, dtype=torch.float32,
                              device=self.stored[KEY].device)
        for i, j in groups:
            out = scratch[:(j - i) * self.row]
            decode_range(self.stored, KEY, i * self.row, out)
            yield i, j, out.view(j - i, *self.shape[1:])

    def direction(self, state: dict, lookahead: Callable, lookahead_rows: Optional[Callable]) -> torch.Tensor:
        """The forward op's input, as :func:`~geomopt.optim.units.directions.polyak_rows` forms it
        with its updates put off (``fresh``): with Nesterov u = g.lerp(d⁺, 1 − α) into
        ``lookahead(shape, like)`` (``lookahead_rows(u, new, d, gs, α)``: its compiled form, where u
        holds float32, d⁺ written into a scratch of the group's size the commit does not read);
        without, d⁺ as a new float32 stack, put in ``state`` for the commit to encode."""
        alpha, gs = self.alpha, self.gs
        if not self.nesterov:
            new = state[KEY] = torch.empty(self.shape, dtype=torch.float32, device=self.stored[KEY].device)
            for i, j, d in self.groups():
                for r in range(j - i):
                    polyak_lerp(d[r], gs[i + r], alpha, out=new[i + r])
            return new
        like = torch.empty((), dtype=torch.float32, device=self.stored[KEY].device)
        u = lookahead(self.shape, like)
        self.in_place = u.dtype == torch.float32
        for i, j, d in self.groups():
            if self.in_place and lookahead_rows is not None:  # compiled: d⁺ into a group-sized scratch, u from it
                lookahead_rows(u[i:j], torch.empty_like(d), d, gs[i:j], alpha)
                continue
            if self.in_place:
                polyak_lookahead_rows(u[i:j], d, gs[i:j], alpha)
                continue
            for r in range(j - i):  # d⁺ in the group's scratch, u in the forward op's dtype from it
                polyak_lerp(d[r], gs[i + r], alpha, out=d[r])
                polyak_lookahead(gs[i + r], d[r], alpha, out=u[i + r])
        return u

    def commit(self) -> dict:
        """New stored entries of d⁺ = d.lerp(g, α) (Nesterov: the put-off write, group by group:
        decoded, stepped in the group's scratch, encoded); none without Nesterov (d⁺ is in the
        state, float32, encoded with the rest). Allocates; writes nothing live."""
        if not self.nesterov:
            return {}
        stored = self.codec.empty(KEY, self.shape[0] * self.row, self.stored[KEY].device)
        for i, j, d in self.groups():
            if self.in_place:
                polyak_lerp(list(d.unbind(0)), self.gs[i:j], self.alpha)
            else:
                for r in range(j - i):
                    polyak_lerp(d[r], self.gs[i + r], self.alpha, out=d[r])
            self.codec.encode_range(KEY, d.reshape(-1), i * self.row, self.shape, stored)
        return shaped(stored, self.shape)
