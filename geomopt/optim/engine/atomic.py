"""A step never half-applies.

A step is a sequence of jobs (a bucket of same-shape tensors of a rule, or a flat call of an
elementwise rule), each of which writes its tensors, their state and its counters at once, after
every operator request it makes (forward op, post-stages, backward op) has answered and after
everything it allocates (its state's encoding into bfloat16 or int8, its counters' sums, an
elementwise rule's scratch and new state buffers): the writes themselves allocate nothing. An
exception (an operator error, out of memory, a fault) therefore reaches a job before it wrote its
parameters; state it updated in place before that (momentum, moments) is restored from a journal
copy (:func:`journal`), so the job leaves every bit as it found it. Jobs that finished
before are *committed*. :class:`PendingStep` records them: the exception carries a note naming
the committed and the interrupted tensors, and the next ``step()`` (with the same gradients)
applies only the tensors not yet committed, then advances the step counts once, so the two calls
give the bits of one clean step.

Scope: one process. Under torch.distributed an exception on one rank breaks the collectives'
sequence for all, so such a run restarts from a checkpoint; there no journal is kept (it would
hold a copy of every bucket's state at once while the rounds run in lockstep).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

import torch


@dataclass
class PendingStep:
    """An interrupted step: ``done`` the ids of the parameters whose update for this step is
    written, ``names`` theirs (for messages and checkpoints), ``groups`` the param groups that
    took part (their step counts advance when the step completes)."""

    done: set = field(default_factory=set)
    names: list = field(default_factory=list)
    groups: set = field(default_factory=set)

    def to_dict(self) -> dict:
        return dict(done=list(self.names), groups=sorted(self.groups))


def journal(tensors: Iterable[torch.Tensor]) -> list:
    """(live tensor, copy) pairs: what :func:`restore` writes back."""
    return [(t, t.clone()) for t in tensors]


def restore(saved: list) -> None:
    for live, copy in saved:
        live.copy_(copy)


def abort(jobs: Iterable) -> None:
    """Unwind in-flight jobs after a failure: each restores its journal."""
    for job in jobs:
        job.abort()


def drive(run: Callable, jobs: list, committed: Callable[[int], None], barrier: Optional[Callable] = None,
          lockstep: bool = False) -> bool:
    """Drive the jobs (``(index, job)``; ``job.advance(answer)`` returns its next operator request,
    or None when it is done; ``run`` answers a list of requests). ``lockstep`` (a distributed
    executor): each round's requests go to ``run`` together, so it exchanges once per round, the
    same requests in the same order on every rank. Otherwise each job runs to its end before the
    next starts, so at most one job is in flight when something fails; with a ``barrier``, only
    after a first round in which every job makes its first request (the forward ops launched) and
    the barrier ran: False from it abandons the step (False returned; no job has written).
    ``committed(index)`` is called as each job finishes; an exception unwinds the jobs in flight
    (:func:`abort`) and propagates."""
    pending = [(index, job, None) for index, job in jobs]
    if lockstep:
        while pending:
            pending = _round(run, pending, committed)
        return True
    if barrier is not None:
        pending = _round(run, pending, committed)
        try:
            go = barrier()
        except BaseException:
            abort(job for _, job, _ in pending)
            raise
        if not go:
            abort(job for _, job, _ in pending)  # (nothing was written before the barrier)
            return False
    for k, (index, job, answer) in enumerate(pending):
        try:
            _finish(run, index, job, answer, committed)
        except BaseException:
            abort(job for _, job, _ in pending[k + 1:])
            raise
    return True


def _round(run: Callable, pending: list, committed: Callable[[int], None]) -> list:
    """One round: each job in ``pending`` (index, job, its answer) takes its answer and makes its
    next request (or finishes), and ``run`` answers them together."""
    nxt: list = []
    for k, (index, job, answer) in enumerate(pending):
        try:
            request = job.advance(answer)
        except BaseException:  # the job restored its own journal
            abort(j for _, j, _ in nxt + pending[k + 1:])
            raise
        if request is None:
            committed(index)
        else:
            nxt.append((index, job, request))
    try:
        answers = run([req for _, _, req in nxt]) if nxt else []
    except BaseException:
        abort(job for _, job, _ in nxt)
        raise
    return [(index, job, a) for (index, job, _), a in zip(nxt, answers)]


def _finish(run: Callable, index: int, job, answer, committed: Callable[[int], None]) -> None:
    """Run one job to its end, answering its requests one at a time."""
    while True:
        request = job.advance(answer)  # an exception: the job restored its own journal
        if request is None:
            committed(index)
            return
        try:
            answer = run([request])[0]
        except BaseException:
            job.abort()
            raise


def interrupted(pending: Optional[PendingStep], err: BaseException, jobs: list, done: list, groups: list,
                plans: list, local: bool) -> Optional[PendingStep]:
    """The pending step after ``err`` interrupted a step whose jobs ``done`` (indices into
    ``jobs``: (program, [(param, plan)])) committed, said in a note on the exception
    (its type unchanged, so ``except torch.OutOfMemoryError`` still works); None when nothing is
    written (the step can simply be called again)."""
    if not done and pending is None:
        return None
    pending = pending or PendingStep()
    for _, items in (jobs[j] for j in done):
        pending.done.update(id(p) for p, _ in items)
        pending.names.extend(pp.name for _, pp in items)
    pending.groups |= {prog.group for prog, _ in jobs}
    committed = [(g["rule"], [pp.name for p, pp in zip(g["params"], ps) if id(p) in pending.done])
                 for g, ps in zip(groups, plans)]
    rest: dict = {}
    for j, (prog, items) in enumerate(jobs):
        if j not in done:
            rest.setdefault(groups[prog.group]["rule"], []).extend(pp.name for _, pp in items)
    note = interrupted_note([c for c in committed if c[1]], list(rest.items()))
    if not local:
        note += ("\n  Under torch.distributed the ranks' collectives are out of step after this: restart from "
                 "the last checkpoint.")
    if hasattr(err, "add_note"):  # Python >= 3.11
        err.add_note(note)
    return pending


def interrupted_note(done: list, rest: list) -> str:
    """What an exception that interrupted a step says: ``done`` / ``rest`` are (rule, names)."""

    def listing(parts: list) -> str:
        out = []
        for rule, names in parts:
            shown = ", ".join(names[:4]) + (f", … ({len(names)} tensors)" if len(names) > 4 else "")
            out.append(f"rule '{rule}': {shown}")
        return "; ".join(out) or "none"

    return ("geomopt: this step was interrupted and applied in part.\n"
            f"  committed (updated for this step): {listing(done)}\n"
            f"  not applied (parameters and optimizer state as before the step): {listing(rest)}\n"
            "  Call step() again with the same gradients to apply only the tensors not applied; the step "
            "counts advance then (opt.pending_step lists the committed tensors).")
