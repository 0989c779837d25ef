"""benchmarks/traffic.py: the dispatch-level byte counter on ops whose traffic is known by hand,
and the script's --small record (its ratios are its totals over its floors, at least 1)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from geomopt.geometry.view import concrete, matrix_shapes

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def traffic():
    spec = importlib.util.spec_from_file_location("bench_traffic", BENCH / "traffic.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _count(traffic, fn) -> dict:
    """(calls, read, written) per op that moved bytes."""
    with traffic.Traffic() as t:
        fn()
    return {name: tuple(row) for name, row in t.ops.items() if row[1] or row[2]}


def test_an_add_reads_both_operands_and_writes_its_result(traffic):
    a, b = torch.randn(100), torch.randn(100, dtype=torch.float64)
    assert _count(traffic, lambda: a + a) == {"add": (1, 800, 400)}
    assert _count(traffic, lambda: b.add_(b)) == {"add_": (1, 1600, 800)}  # in place: self read and written


def test_an_in_place_foreach_lerp_sums_over_its_lists(traffic):
    xs, ys = [torch.randn(10), torch.randn(20, 3)], [torch.randn(10), torch.randn(20, 3)]
    n = (10 + 60) * 4
    # self read and written, end read; the weight is a Python number
    assert _count(traffic, lambda: torch._foreach_lerp_(xs, ys, 0.5)) == {"_foreach_lerp_": (1, 2 * n, n)}


def test_a_matmul_reads_its_operands_and_writes_its_result(traffic):
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    with traffic.Traffic() as t:
        a @ b
    assert dict(t.ops) == {"mm": [1, (12 + 20) * 4, 15 * 4]}
    assert t.matmul == t.total == (12 + 20 + 15) * 4


def test_views_move_nothing_and_a_copy_only_writes_its_destination(traffic):
    x, y = torch.randn(6, 4), torch.empty(4, 6)
    with traffic.Traffic() as t:
        x.t()
        x.reshape(-1)[:5]
        x.unsqueeze(0).expand(3, 6, 4)
        torch.empty(1000)
    assert t.total == 0
    # a reshape that must copy reads and writes every entry
    assert _count(traffic, lambda: x.t().reshape(-1)) == {"clone": (1, 96, 96)}
    assert _count(traffic, lambda: y.copy_(x.t())) == {"copy_": (1, 96, 96)}
    assert _count(traffic, lambda: torch.zeros(8)) == {"zeros": (1, 0, 32)}


def test_the_small_run_records_consistent_ratios(traffic, tmp_path):
    assert traffic.main(["--small", "--specs", "sign-descent", "--no-torch", "--warmup", "1",
                         "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "traffic.json").read_text())
    assert record["small"] and [r["name"] for r in record["rows"]] == ["sign-descent"]
    row = record["rows"][0]
    parts = row["floor_parts"]
    assert parts["total"] == parts["grads"] + parts["params"] + parts["state"] == row["elementwise_floor_bytes"]
    # sign descent with momentum: one float32 momentum per tensor, as large as the parameters
    assert parts["grads"] == 4 * row["parameters"] and parts["params"] == 8 * row["parameters"]
    assert parts["state"] >= 8 * row["parameters"]
    assert row["total_bytes"] == row["elementwise_bytes"] + row["matmul_bytes"]
    assert row["floor_bytes"] == row["elementwise_floor_bytes"] + row["matmul_bytes"]
    assert row["ratio"] == pytest.approx(row["total_bytes"] / row["floor_bytes"], rel=1e-12) and row["ratio"] >= 1
    assert row["elementwise_ratio"] == pytest.approx(row["elementwise_bytes"] / row["elementwise_floor_bytes"],
                                                     rel=1e-12) and row["elementwise_ratio"] >= 1
    assert 0 < sum(o["read_bytes"] + o["written_bytes"] for o in row["top_ops"]) <= row["total_bytes"]


@pytest.mark.parametrize("spec", ["adamw", "muon", "adamw-hybrid", "normuon", "sign-descent"])
def test_a_capturable_step_moves_no_more_bytes_than_the_eager_one(traffic, spec):
    """Adam's rules step through the fused kernel in both (found_inf: the capturable one reads the
    gradients as they are). A batched Polyak rule reads its momentum ahead from one copy of its
    gradients, selected by the flag as it is stacked (two passes over them), u = d.lerp(G, 1 − β²)
    and d ← d.lerp(G, α·ok) in place at the commit, where the default CPU step reads G three times
    (d⁺ into u, u over it, the put-off update): one pass over the hidden matrices fewer, which
    adamw-hybrid spends on selecting X⁺ against X (three passes where the default step copies it
    back: a prox need not leave X as it is on a step of length 0). A flat rule not compiled zeroes
    its gradients where the flag is false (one read and one write of them: eager ops turn 0·NaN
    into NaN; with ``fuse`` the compiled loop selects them inside: the test below): its only
    allowance, beside 0-d values (the exact finiteness test's min and max per tensor where the
    eager step sums, γ·ok, α·ok, the device counts: about a hundred bytes a tensor) and, for
    normuon, its per-row statistics selected by the flag (a few numbers a row)."""
    torch.set_grad_enabled(False)
    try:
        eager = traffic.measure(traffic.gpt2(True), traffic.geomopt_optimizer(spec), 1)
        captured = traffic.measure(traffic.gpt2(True), traffic.geomopt_optimizer(spec, capturable=True), 1)
        model = traffic.gpt2(True)
        programs = traffic.geomopt_optimizer(spec, capturable=True)(model).engine.programs
    finally:
        torch.set_grad_enabled(True)
    progs = [prog for group in programs for prog in group]
    sizes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    zeroed = 2 * sum(sizes[n] for prog in progs if prog.variant == "flat" and not prog.fused for n in prog.names)
    saved = sum(sizes[n] for prog in progs if prog.variant == "batched" and prog.write != "stacked"
                for n in prog.names)
    assert all(prog.direction_form == "ahead" for prog in progs if prog.variant == "batched")
    rows = captured["floor_parts"]["state"] - traffic.measure(traffic.gpt2(True), traffic.geomopt_optimizer("muon"),
                                                              1)["floor_parts"]["state"] if spec == "normuon" else 0
    scalars = 128 * len(list(model.parameters()))
    assert captured["matmul_bytes"] == eager["matmul_bytes"]
    assert captured["elementwise_floor_bytes"] == eager["elementwise_floor_bytes"]
    assert captured["elementwise_bytes"] <= eager["elementwise_bytes"] + zeroed - saved + 8 * rows + scalars, (
        captured["top_ops"], eager["top_ops"])
    assert captured["elementwise_bytes"] >= eager["elementwise_bytes"] + zeroed - saved - scalars
    if spec != "sign-descent":  # no flat rule outside the fused kernel: no more than the default step
        assert captured["elementwise_bytes"] <= eager["elementwise_bytes"] + scalars
    if spec == "adamw":  # one fused kernel over everything in both, at the floor; nothing zeroed
        assert zeroed == 0 and captured["top_ops"][0]["op"] == "_fused_adamw_"
        fused = captured["top_ops"][0]["read_bytes"] + captured["top_ops"][0]["written_bytes"]
        assert abs(fused - eager["elementwise_floor_bytes"]) <= scalars  # the counts: a few bytes each


def test_a_compiled_region_counts_what_it_reads_once_and_what_it_writes_once(traffic):
    """fused.run's declaration: ``out`` written, ``written`` read and written, ``read`` and the 0-d
    coefficients read; inductor's kernels themselves are not seen by the dispatcher."""
    from geomopt.optim.engine import fused
    xs, steps = [torch.randn(10), torch.randn(4, 5)], [torch.randn(10), torch.randn(4, 5)]
    expected = [x * 0.5 + s * 0.25 for x, s in zip(xs, steps)]
    keep, coef = fused.scalar(0.5, xs[0]), fused.scalar(0.25, xs[0])
    n = 30 * 4
    with traffic.Traffic() as t:
        fused.run(fused.compiled_write("decoupled", True), [], [xs], [steps], keep, coef)
    assert {k: tuple(v) for k, v in t.ops.items()} == {"compiled:write_tail": (1, 2 * n + 16, n)}
    assert all(torch.allclose(x, e, rtol=0, atol=1e-7) for x, e in zip(xs, expected))
    assert fused.run is not None and fused.run.__name__ == "run"  # the counter put the real one back


def _ops(traffic, spec: str, fuse: bool):
    """One step's (ops, elementwise floor parts, model, programs) after a warm-up step, --small."""
    model = traffic.gpt2(True)
    params = list(model.parameters())
    opt = traffic.geomopt_optimizer(spec, fuse=fuse)(model)
    for k in range(2):
        traffic.random_grads(params, k)
        if k:
            with traffic.Traffic() as t:
                opt.step()
        else:
            opt.step()
    ops = {name: r + w for name, (_, r, w) in t.ops.items() if name not in traffic.MATMUL_OPS}
    return ops, traffic.elementwise_floor(params, opt.state), model, opt.engine.programs


def test_a_fused_step_moves_only_what_its_compiled_regions_save(traffic):
    """sign descent, compiled whole: the floor plus the finiteness test's read of G (1.2× the
    elementwise floor)."""
    torch.set_grad_enabled(False)
    try:
        sign = traffic.measure(traffic.gpt2(True), traffic.geomopt_optimizer("sign-descent", fuse=True), 1)
    finally:
        torch.set_grad_enabled(True)
    parts = sign["floor_parts"]
    scalars = 64 * 30
    assert sign["top_ops"][0]["op"] == "compiled:flat_tail"
    assert 0 <= sign["elementwise_bytes"] - (parts["total"] + parts["grads"]) <= scalars
    assert sign["elementwise_ratio"] <= 1.3


@pytest.mark.parametrize("spec, write", [("muon", "compiled:write_tail"), ("adamw-hybrid", "compiled:prox_tail")])
def test_a_fused_spectral_step_passes_over_its_hidden_matrices_six_or_seven_times(traffic, spec, write):
    """Under fuse a hidden matrix's elementwise bytes are the floor's five passes (G read, d and X
    read and written) and one or two more: u written by the look-ahead (one compiled pass: d and G
    read, d⁺ and u written, no put-off update reading G again), and for adamw-hybrid the iteration's
    result read by the write-back (one compiled pass over X with its prox); muon's write-back is the
    iteration's last product itself, X ← X(1 − γλ) − γρ·F·Xₖ by ``addmm_``'s β and α (its addend X
    read and written once: the floor's, counted here; its operands are the product's), so that
    result is neither written nor read (where nothing comes between the op and the write: not a
    matrix read through a view, such as a fused q/k/v's blocks). Nothing pre-normalizes,
    scales or transposes X, nor scales a small factor in a pass of its own: the first factor
    C₀ = f·(aI + b·f²A + c·f⁴A²) is one compiled pass over the first Gram matrix A and A² (3k² per
    matrix), the last factor's scale is in the product's coefficients, and a later factor's a is
    added on its diagonal alone. The finiteness test reads the flat rules' gradients only (the
    hidden ones are tested by tr A, which the first factor computes anyway). Beyond those: Adam's
    fused kernel at its floor. The eager step moves at least 1.3× the elementwise floor more
    (muon: 2.90 against 1.51 on the --small model)."""
    torch.set_grad_enabled(False)
    try:
        ops, floor, model, programs = _ops(traffic, spec, fuse=True)
        eager, _, _, _ = _ops(traffic, spec, fuse=False)
    finally:
        torch.set_grad_enabled(True)
    hidden = {n for progs in programs for p in progs if p.compiled and p.variant == "batched" for n in p.names}
    params = {n: p for n, p in model.named_parameters() if n in hidden}
    pass_ = 4 * sum(p.numel() for p in params.values())  # one pass over them
    product = {n for progs in programs for p in progs if p.product for n in p.names}
    last = 4 * sum(p.numel() for n, p in params.items() if n in product)  # written by the last product
    assert (last > 0) is (spec == "muon")
    plans = {pp.name: pp for gplans in traffic.geomopt_optimizer(spec, fuse=True)(model).engine.plans for pp in gplans}
    grams = 4 * sum(min(m, n) ** 2 for name in hidden for m, n in  # one k×k matrix per matrix of a view
                    matrix_shapes(concrete(plans[name].geometry, plans[name].op_shape), plans[name].op_shape))
    scalars = 64 * len(list(model.parameters()))
    assert hidden and abs(ops["compiled:lookahead_rows_into"] - 4 * pass_) <= scalars
    assert abs(ops[write] - 3 * (pass_ - last)) <= scalars
    assert abs(ops.get("addmm_", 0) - 2 * last) <= scalars
    assert not {"div", "linalg_vector_norm", "copy_", "_foreach_lerp_", "lerp", "add", "_foreach_copy_", "mul_",
                "mul"} & {name for name, moved in ops.items() if moved > scalars}, ops
    assert abs(ops["compiled:first_factor_into"] - 3 * grams) <= scalars  # A and A² read, C₀ written
    assert abs(ops["sum"] - (floor["grads"] - pass_)) <= scalars  # the flat rules' gradients alone
    diagonals = ops.get("add_", 0)  # a·I added to the later factors: k read and written per matrix and step
    assert diagonals <= 0.25 * grams  # (2k·4 steps against k² per matrix: 1/8 at k = 64)
    total = sum(ops.values())
    above = total - floor["total"] - pass_ - (pass_ - last) - 3 * grams - (floor["grads"] - pass_) - diagonals
    assert abs(above) <= 4 * scalars, ops  # 0-d values: counts, the prenorm factors, the test's flags
    assert total / floor["total"] <= (1.45 if spec == "muon" else 1.55)
    assert sum(eager.values()) - total >= 1.3 * floor["total"]


@pytest.mark.parametrize("spec", ["sign-descent", "muon", "adamw-hybrid", "normuon"])
def test_a_fused_capturable_step_moves_the_fused_steps_bytes_and_two_passes_over_the_hidden_momentum(
        traffic, spec, monkeypatch):
    """With ``fuse=True`` a capturable step's compiled loops read the gradients as they are and
    select them by the device's flag inside (sign descent's whole flat step, the look-ahead): no
    selected copy of G is written, and the look-ahead writes d⁺ into the momentum in place (a
    captured step's state keeps its storage), so the commit copies nothing. Over the fused step's
    bytes (0-d values aside: the exact test's min and max, γ·ok, α·ok, the device counts) it moves
    two passes over the hidden matrices: the journal, d as it was, written by the look-ahead's loop
    (restored if the step is interrupted before its commit), and the device test's read of the
    hidden gradients (the look-ahead selects them by the flag, which must come first, where the
    fused step's deferred test reads its iterations' traces). Inside a capture (a CUDA graph,
    ``torch.compile``), where nothing is restored, no journal is written: one pass. Beyond those,
    what a capturable step's iteration does not share with the fused step's (no host reads tr A's
    range): the folded form's own first-factor scalings, and where fused muon's last product
    accumulates into X, the result written and read by the write-back. Fewer bytes than the eager
    step for every spec. adamw-hybrid's entrywise prox runs in the compiled in-place
    write-back with γ·ok (a skipped step divides X by 1 + 0·λ: X itself), so no stacked Y is formed
    or selected."""
    from geomopt.optim.engine import fused as fused_module

    torch.set_grad_enabled(False)
    try:
        eager = traffic.measure(traffic.gpt2(True), traffic.geomopt_optimizer(spec), 1)
        fused = traffic.measure(traffic.gpt2(True), traffic.geomopt_optimizer(spec, fuse=True), 1)
        captured = traffic.measure(traffic.gpt2(True), traffic.geomopt_optimizer(spec, capturable=True, fuse=True), 1)
        model = traffic.gpt2(True)
        programs = traffic.geomopt_optimizer(spec, capturable=True, fuse=True)(model).engine.programs
        monkeypatch.setattr(fused_module, "capturing", lambda: True)  # as inside a CUDA-graph capture
        graph = traffic.measure(traffic.gpt2(True), traffic.geomopt_optimizer(spec, capturable=True, fuse=True), 1)
    finally:
        torch.set_grad_enabled(True)
    progs = [p for group in programs for p in group]
    assert not any(p.variant == "batched" and p.write == "stacked" for p in progs)  # the prox in the write-back
    momentum = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                   if n in {n for prog in progs if prog.variant == "batched" for n in prog.names})
    assert (momentum > 0) == (spec != "sign-descent")
    scalars = 128 * len(list(model.parameters()))
    # (fused muon's last product accumulates into X: its result is not written)
    assert fused["matmul_bytes"] <= captured["matmul_bytes"] <= eager["matmul_bytes"]
    assert captured["elementwise_floor_bytes"] == eager["elementwise_floor_bytes"]
    assert captured["elementwise_bytes"] <= eager["elementwise_bytes"], (captured["top_ops"], eager["top_ops"])
    # normuon's per-row statistics: selected by the flag (kept, then where), a few numbers a row
    rows = (fused["floor_parts"]["state"] - traffic.measure(traffic.gpt2(True), traffic.geomopt_optimizer(
        "muon", fuse=True), 1)["floor_parts"]["state"]) // 2 if spec == "normuon" else 0
    # beyond the journal and the test: where fused muon's last product accumulates into X, the
    # iteration's result read by the capturable step's write-back (its result is not written by the
    # fused step), and the folded form's own scalings of its first factor (f² on A, f on the factor:
    # 4k² where the fused step's one pass moves 3k²: with no host to read tr A, the hook's range is
    # not checked)
    plans = {pp.name: pp for gplans in traffic.geomopt_optimizer(spec, fuse=True)(model).engine.plans for pp in gplans}
    grams = 4 * sum(min(m, n) ** 2 for prog in progs if prog.variant == "batched" for name in prog.names
                    for m, n in matrix_shapes(concrete(plans[name].geometry, plans[name].op_shape),
                                              plans[name].op_shape))
    extra = captured["elementwise_bytes"] - fused["elementwise_bytes"]
    assert 2 * momentum - scalars <= extra <= 3 * momentum + grams + 8 * rows + scalars, (
        extra, momentum, grams, rows, captured["top_ops"], fused["top_ops"])
    assert abs(captured["elementwise_bytes"] - graph["elementwise_bytes"] - momentum) <= scalars  # the journal
    moved = {o["op"]: o["read_bytes"] + o["written_bytes"] for o in captured["top_ops"]}
    assert moved.get("where", 0) <= scalars and moved.get("copy_", 0) <= scalars  # nothing selected, nothing copied
    if momentum:  # the look-ahead: d and G read, d⁺, u and the journal written; without the journal one pass less
        look = {o["op"]: o["read_bytes"] + o["written_bytes"] for o in graph["top_ops"]}
        assert abs(moved["compiled:captured_lookahead_into"] - 5 * momentum) <= scalars
        assert abs(look["compiled:captured_lookahead_into"] - 4 * momentum) <= scalars


def test_a_fused_normuon_step_reads_its_hidden_matrices_once_more_than_muon(traffic):
    """NorMuon's post-stages (a per-row second moment of U, the norm match) under fuse: one
    compiled read of U for its per-row sums of squares, the stages' arithmetic on those (a few
    numbers per row), and their factor per row read by the compiled write-back beside U. So the
    step moves muon's bytes, one pass over the hidden matrices more (that read of U) and the
    second moment's rows, and U's read by the write-back where muon's last product writes X itself
    (the factor per row comes between the iteration and the write). Its finiteness test is
    deferred as muon's is (the stages run after the barrier), taken from the iteration's trace, so
    the hidden gradients are not read for it. The eager stages pass over U about ten times (mul,
    div, linalg_vector_norm, mean: normuon 3.00 against muon's 1.71 on the --small model, fused,
    before the row forms)."""
    torch.set_grad_enabled(False)
    try:
        ops, floor, model, programs = _ops(traffic, "normuon", fuse=True)
        muon, muon_floor, _, muon_programs = _ops(traffic, "muon", fuse=True)
    finally:
        torch.set_grad_enabled(True)
    hidden = {n for progs in programs for p in progs if p.compiled and p.variant == "batched" for n in p.names}
    pass_ = 4 * sum(p.numel() for n, p in model.named_parameters() if n in hidden)
    rows = (floor["state"] - muon_floor["state"]) // 2  # the second moment: one number per row (and its count)
    scalars = 64 * len(list(model.parameters()))
    assert hidden and abs(ops["compiled:row_squares_into"] - pass_) <= rows + scalars
    product = {n for progs in muon_programs for p in progs if p.product for n in p.names}
    last = 4 * sum(p.numel() for n, p in model.named_parameters() if n in product)
    assert 0 < last < pass_ and not any(p.product for progs in programs for p in progs)
    assert abs(ops["compiled:row_write_tail"] - 3 * pass_) <= rows + scalars
    assert not {"div", "linalg_vector_norm", "mean", "copy_"} & {n for n, moved in ops.items() if moved > 4 * rows}, ops
    extra = sum(ops.values()) - sum(muon.values())
    assert pass_ + last <= extra <= pass_ + last + 32 * rows, (extra, pass_, rows, ops)  # the rows' arithmetic: 25
    assert sum(ops.values()) / floor["total"] <= 1.9
