"""State kept with each whole matrix on its owner (:mod:`geomopt.optim.engine.owned`), in one process:
the owner's forward op on some rows of a bucket, whose tensors may have stepped different numbers
of times, gives each matrix the step it takes alone and keeps its state per tensor; owners are a
balanced split fixed by the tensors' FLOPs; an executor sends a request's rows to the owners it names.
(The sharded runs against one process: tests/test_layouts.py.)"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import typed_fragments as typed
from geomopt.compile.fragments import ResolvedGeometry
from geomopt.distributed.executors import ReplicatedExecutor, Request, matrix_cost
from geomopt.geometry.learned import kronecker
from geomopt.optim.engine.owned import owned_forward, owners
from geomopt.optim.units.state_keys import COUNTS, geometry_state, owner_state
from geomopt.registry import LOCAL, OWNER

F64 = torch.float64


def G(**fields) -> ResolvedGeometry:
    """A geometry as a plan holds it (the spec's model, typed), from its fields."""
    return typed.geometry({"reference": {"kind": "indicator"}, **fields} if fields["kind"] == "spectral" else fields)


GEOMETRIES = {
    "shampoo": G(kind="kronecker", method="shampoo", beta=0.9, damping=1e-3, every=1, exponent=None,
                    root="eigh", graft="adam", betas=[0.9, 0.99], eps=1e-8, max_dim=None),
    "soap": G(kind="kronecker", method="soap", beta=0.95, betas=[0.9, 0.95], eps=1e-8, every=2, max_dim=5),
    "psgd": G(kind="kronecker", method="psgd", momentum=0.9, precond_lr=0.1, every=1, max_dim=None),
}


def _alone(g: torch.Tensor, state: dict, geometry: dict) -> torch.Tensor:
    """One matrix stepped by the forward op as a bucket of one."""
    return kronecker(g.unsqueeze(0), geometry, radius=0.5, batch_dims=1, state=state)[0]


@pytest.mark.parametrize("method", sorted(GEOMETRIES))
def test_owned_rows_step_as_each_matrix_alone(method):
    """A bucket of 4 (5, 6) tensors; this rank owns rows 0, 2 and 3; tensor 3 misses the first step,
    so at the second its count differs from rows 0 and 2 (they step apart). Each row's direction and
    state equal those of its matrix stepped alone."""
    geometry = GEOMETRIES[method]
    gen = torch.Generator().manual_seed(0)
    grads = torch.randn(3, 4, 5, 6, generator=gen, dtype=F64)
    params = [torch.zeros(5, 6) for _ in range(4)]
    items = [(p, None) for p in params]
    state_of: dict = {p: {} for p in params}
    alone: dict = {r: {} for r in range(4)}
    keys = geometry_state(geometry)
    fn = owned_forward(state_of, items, geometry, keys, radius=0.5)
    for step, rows in enumerate(([0, 2], [0, 2, 3], [0, 2, 3])):
        out, flags = fn(grads[step, rows], rows)
        assert flags is None and out.shape == (len(rows), 5, 6)
        for k, r in enumerate(rows):
            want = _alone(grads[step, r], alone[r], geometry)
            assert torch.allclose(out[k], want, rtol=1e-12, atol=1e-12), (method, step, r)
            got_state = state_of[params[r]]
            assert set(got_state) == set(keys)
            for key in keys:
                if isinstance(alone[r][key], int):
                    assert int(got_state[key]) == alone[r][key]
                else:
                    assert torch.allclose(got_state[key], alone[r][key].reshape(got_state[key].shape),
                                          rtol=1e-12, atol=1e-12), (method, key)
    assert state_of[params[1]] == {}  # a row this rank does not own keeps nothing here
    assert int(state_of[params[3]][keys[-1]]) == int(state_of[params[0]][keys[-1]]) - 1  # stepped apart


def test_owners_are_a_balanced_split_of_the_flops():
    plans = [SimpleNamespace(op_shape=shape, matrix_cost=None) for shape in ((64, 32), (32, 32), (32, 32), (16, 32))]
    items = [(torch.zeros(1), pp) for pp in plans]
    got = owners(items, 2)
    ranks = [got[id(p)] for p, _ in items]
    assert ranks == [0, 1, 1, 0]  # 65536 | 32768 + 32768, then 8192 onto the lighter rank 0
    assert matrix_cost((16, 32)) == 16 * 32 * 16 and matrix_cost((4, 2, 3)) == 4 * 6 * 4
    assert matrix_cost((4, 2, 3), 7.0) == 7.0


def test_a_request_with_fixed_owners_goes_to_them():
    executor = object.__new__(ReplicatedExecutor)
    executor.world, executor.rank = 2, 0
    x = torch.zeros(3, 4, 4)
    free = Request(lambda m: (m, None), x, OWNER)
    fixed = Request(lambda m, rows: (m, None), x, OWNER, owners=(1, 1, 0))
    local = Request(lambda m: (m, None), x, LOCAL)
    got = executor._owners([free, fixed, local])
    assert got[1] == [1, 1, 0] and got[2] == [-1, -1, -1]
    assert sorted(got[0]) == [0, 0, 1] or sorted(got[0]) == [0, 1, 1]
    assert math.isclose(free.row_cost(), 64.0)


def test_only_a_sharded_stateful_owner_op_keeps_state_on_its_owner():
    assert owner_state(GEOMETRIES["soap"], True) == geometry_state(GEOMETRIES["soap"])
    assert owner_state(GEOMETRIES["soap"], False) == ()
    assert owner_state(G(kind="adam"), True) == ()  # local on shards: laid out like the parameter
    assert owner_state(G(kind="spectral"), True) == ()  # owner, but keeps no state


def test_an_owner_stores_bf16_factors_as_one_process_does():
    """Factors in bfloat16 (``state: {factors: bfloat16}``): the owner decodes them, steps the rows it owns
    and rounds each factor with the random bits of its tensor (name, step, entry): the stored bits are
    the one-process codec's for the same tensors, whichever rows this rank owns."""
    from geomopt.optim.persist.state_codec import Codec
    from geomopt.optim.units.state_keys import FACTORS

    geometry = GEOMETRIES["shampoo"]
    gen = torch.Generator().manual_seed(1)
    grads = torch.randn(2, 3, 5, 6, generator=gen)
    params = [torch.zeros(5, 6) for _ in range(3)]
    items = [(p, SimpleNamespace(name=f"w{i}")) for i, p in enumerate(params)]
    keys = geometry_state(geometry)
    owned: dict = {p: {} for p in params}
    whole: dict = {}  # the bucket of all three, as one process keeps it (stacked)
    for step in range(2):
        fn = owned_forward(owned, items, geometry, keys, radius=0.5, factors="bfloat16", step=step + 1)
        fn(grads[step, [0, 2]], [0, 2])
        fn(grads[step, [1]], [1])
        whole = Codec.decode(whole)
        kronecker(grads[step], geometry, radius=0.5, batch_dims=1, state=whole)
        whole = Codec("float32", ("w0", "w1", "w2"), step + 1, factors="bfloat16").encode(whole)
    for key in keys:
        for r, p in enumerate(params):
            got = owned[p][key]
            if key in FACTORS:
                assert got.dtype == torch.bfloat16, key
                assert torch.equal(got, whole[key][r]), (key, r)
            elif isinstance(whole[key], torch.Tensor):
                assert got.dtype == torch.float32 and torch.equal(got, whole[key][r].reshape(got.shape)), key


def test_rows_of_reads_the_rows_of_one_buffer_in_place_and_stacks_anything_else():
    from geomopt.optim.engine.owned import rows_of

    buf = torch.randn(4, 3, 3, generator=torch.Generator().manual_seed(2))
    rows = list(buf.unbind(0))
    got = rows_of(rows)
    assert torch.equal(got, buf) and got.data_ptr() == buf.data_ptr()  # a view: the step writes the entries
    for entries in (rows[::-1], rows[1:3:2] + rows[:1], [r.clone() for r in rows], [r.mT for r in rows]):
        got = rows_of(entries)
        assert torch.equal(got, torch.stack(entries)) and got.data_ptr() != buf.data_ptr()
    assert rows_of(rows[1:3]).data_ptr() == rows[1].data_ptr()  # consecutive rows of it: still a view


@pytest.mark.parametrize("method", sorted(GEOMETRIES))
def test_an_owner_steps_its_rows_state_where_it_lies_without_a_copy(method, monkeypatch):
    """The rows an owner stepped together are views of one buffer after the step, and the next step
    of the same rows writes that buffer (the state's storage stays), with the bits of an owner that
    stacks a copy of the state every step."""
    from geomopt.optim.engine import owned

    geometry = GEOMETRIES[method]
    grads = torch.randn(3, 3, 5, 6, generator=torch.Generator().manual_seed(3), dtype=F64)
    keys = geometry_state(geometry)
    runs = []
    for rows_of in (owned.rows_of, torch.stack):
        monkeypatch.setattr(owned, "rows_of", rows_of)
        params = [torch.zeros(5, 6) for _ in range(3)]
        state_of: dict = {p: {} for p in params}
        fn = owned_forward(state_of, [(p, None) for p in params], geometry, keys, radius=0.5)
        outs, where = [], []
        for step in range(3):
            outs.append(fn(grads[step], [0, 1, 2])[0])
            where.append({k: state_of[params[0]][k].untyped_storage().data_ptr() for k in keys
                          if k not in COUNTS and state_of[params[0]][k].numel()})
        runs.append((outs, [state_of[p] for p in params], where))
    (outs, states, where), (copied_outs, copied_states, copied_where) = runs
    assert all(torch.equal(a, b) for a, b in zip(outs, copied_outs))
    for mine, theirs in zip(states, copied_states):
        assert all(k in COUNTS or torch.equal(mine[k], theirs[k]) for k in keys)
    assert where[1] == where[2] and copied_where[1] != copied_where[2]
