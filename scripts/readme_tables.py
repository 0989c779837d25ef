#!/usr/bin/env python
"""Generate the result tables and quoted numbers of README.md and of the documentation
(``docs/**/*.md``) from the committed results (``examples/results/*.json``,
``benchmarks/results/catalog.json`` for the catalogue, and ``benchmarks/RESULTS.md``, whose
sections the performance page quotes), so that neither can drift from them.

README.md and the docs pages mark every generated part with a key (each key once, in whichever
of those files it lives). A block (a table and its caption):

    <!-- results:demo -->
    ...
    <!-- /results -->

or a value inside a sentence: ``<!-- results:grokking:clip-epochs -->60–106 epochs<!-- /results -->``.
The text between the markers is replaced by what the key's renderer makes of the JSON. A value
the JSON does not carry (the commit, in records made before they named it) is left as written;
a sentence that no longer fits the numbers (e.g. "every seed groks" when one does not) fails
with a message saying which to rewrite; a committed record made with --quick is refused.

Times are shown as ranges, min–max over the timed runs a record holds (``--record`` repeats each
single-seed training 3 times; multi-seed experiments range over their seeds, each the same work),
with the machine they were measured on where the record has it; a single time is one number.

    python scripts/readme_tables.py            # rewrite the marked parts of README.md and docs/
    python scripts/readme_tables.py --check    # exit 1, with a diff, where a file disagrees
    python scripts/readme_tables.py --print --results runs/demo   # what a run's JSON would give

``--readme FILE`` stands in for README.md and ``--docs DIR`` for docs/ (the tests check copies).

Needs only the standard library.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
RESULTS = ROOT / "examples" / "results"
BENCH_RESULTS = ROOT / "benchmarks" / "RESULTS.md"
MARKER = re.compile(r"<!-- results:(?P<key>[\w.:-]+) -->(?P<body>.*?)<!-- /results -->", re.S)


class Stale(Exception):
    """A README sentence around a generated value no longer fits the results: rewrite it."""


class Unusable(Exception):
    """A results record the README must not quote (a --quick run)."""


class Records:
    """The results records of a folder, loaded on first use."""

    def __init__(self, folder: Path, committed: bool):
        self.folder, self.committed, self._cache = folder, committed, {}

    def __call__(self, stem: str, committed_path: Path | None = None) -> dict:
        """The record ``stem``: ``folder/stem.json``, or ``committed_path`` for a record kept
        elsewhere in the checkout (benchmarks/results/) when reading the committed results."""
        if stem not in self._cache:
            path = committed_path if committed_path is not None and self.committed else self.folder / f"{stem}.json"
            rec = json.loads(path.read_text(encoding="utf-8"))
            quick = rec.get("quick") or (rec.get("settings") or {}).get("quick")
            if self.committed and quick:
                raise Unusable(f"{path} was recorded with --quick: record it again without --quick")
            self._cache[stem] = rec
        return self._cache[stem]


# ---------------------------------------------------------------- formatting


def span(values, fmt: str = "{:.0f}") -> str:
    """``min–max`` of ``values`` in ``fmt``, one number where both ends print the same."""
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo}–{hi}"


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 120:
        return f"{seconds} s"
    m, s = divmod(seconds, 60)
    return f"{m} min {s} s" if m < 60 else f"{m // 60} h {m % 60} min"


def threads_text(rec: dict, threads: int) -> str:
    """``2 torch threads`` and, where the record says how they were chosen, how and under what load."""
    text = plural(threads, "torch thread")
    choice = rec.get("thread_choice")
    if not choice:
        return text
    how = {"probe": "the fastest on a probe of the run's step", "--threads": "set by --threads"}.get(
        choice["how"], f"set by {choice['how']}")
    load = f", load average {choice['load'][0]:.2f} then" if choice.get("load") else ""
    return f"{text}: {how}{load}"


def machine_text(rec: dict) -> str:
    """The machine a record's times were measured on, as far as the record knows it."""
    m = rec.get("machine")
    if not m:
        return (f"a machine the record does not name ({threads_text(rec, rec['threads'])}, "
                f"torch {rec['torch']})")
    text = f"{m['cpu']} ({plural(m['cores'], 'core')}, {threads_text(rec, m['threads'])}), torch {m['torch']}"
    return f"{m['gpu']}, host {text}" if m.get("gpu") else text


def made_text(rec: dict) -> str:
    """``, 2026-11-24, geomopt abc1234``: the record's date and source commit, where it has them."""
    parts = []
    if rec.get("date"):
        parts.append(rec["date"][:10])
    src = rec.get("source")
    if src:
        parts.append(f"geomopt {src['commit']}" + (" with uncommitted changes" if src.get("dirty") else ""))
    return "".join(f", {p}" for p in parts)


def repeat_text(n: int, what: str = "of each optimizer's training") -> str:
    return f"one run {what}" if n == 1 else f"min–max over {n} runs {what}"


def differ_text(rec: dict) -> str:
    return (" The repeated runs' losses differed (nondeterministic kernels); losses are the first run's."
            if rec.get("repeats_identical") is False else "")


def row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def table(head: list[str], rows: list[list]) -> list[str]:
    return [row(*head), "|" + "---|" * len(head), *(row(*r) for r in rows)]


def summary_runs(rec: dict, name: str) -> list[dict]:
    return [r for r in rec["results"]["runs"] if r["optimizer"] == name]


# ---------------------------------------------------------------- demo

DEMO_SPECS = {"spectral-clip": "uScion + spectral-ball clipping"}  # the README's words for the demo's spec


def demo(records) -> str:
    rec = records("demo")
    rows = []
    for r in rec["results"]:
        if r["label"] == "AdamW":
            name = f"AdamW (lr {rec.get('adamw_lr', 3e-3):g}, betas (0.9, 0.95), wd 0.1)"
        else:
            name = f"{r['label']} ({DEMO_SPECS[r['label']]})" if r["label"] in DEMO_SPECS else r["label"]
        times = r.get("seconds_runs") or [r["seconds"]]
        rows.append([name, f"{r['final_val']:.3f}", f"{r['bits_per_byte']:.2f}", span(times)])
    n = len(rec["results"][0].get("seconds_runs") or [0])
    lines = table(["optimizer", "final val. loss (nats/byte)", "bits/byte", "time (s)"], rows)
    lines += ["", f"`{rec['command']}`: {rec['steps']} steps per optimizer, seed {rec['seed']}{made_text(rec)}. "
                  f"Time: {repeat_text(n)}, on {machine_text(rec)}; it varies with the machine's load."
                  + differ_text(rec)]
    return "\n".join(lines)


BUSY_RESULTS = ROOT / "benchmarks" / "results" / "busy_machine.json"


def busy(records) -> str:
    """The README's two commands quiet and beside one busy core (benchmarks/busy_machine.py)."""
    rec = records("busy_machine", BUSY_RESULTS)
    lines = table(["command", "quiet (s)", "one busy core beside it (s)", "busy / quiet"],
                  [[f"`{r['command']}`", f"{r['quiet_s']:.1f}", f"{r['busy_s']:.1f}", f"{r['ratio']:.2f}×"]
                   for r in rec["rows"]])
    m = rec["machine"]
    loads = [ld[0] for r in rec["rows"] for ld in r["load_before_quiet"] if ld]
    quiet = f"; load average {span(loads, '{:.1f}')} before the quiet runs" if loads else ""
    lines += ["", f"`{rec['command']}`{made_text(rec)}: median of {plural(rec['repeats'], 'run')} of each "
                  f"command, quiet and with another process spinning on one core, interleaved, on {m['cpu']} "
                  f"({plural(m['cores'], 'core')}), torch {m['torch']}{quiet}. Goal: at most {rec['goal']}×."]
    return "\n".join(lines)


def busy_line(records) -> str:
    """The demo's and the tests' busy / quiet ratios in a sentence, with the machine and date."""
    rec = records("busy_machine", BUSY_RESULTS)
    rows = [r for r in rec["rows"] if not r["control"]]
    demo = next(r for r in rows if "demo" in r["command"])
    tests = next(r for r in rows if "pytest" in r["command"])
    return (f"`geomopt demo --quick` took {demo['quiet_s']:.0f} s quiet and {demo['busy_s']:.0f} s beside one busy "
            f"core ({demo['ratio']:.2f}×), a fixed subset of the tests {tests['ratio']:.2f}× "
            f"({rec['machine']['cpu']}, {plural(rec['machine']['cores'], 'core')}{made_text(rec)})")


# ---------------------------------------------------------------- grokking

GROK_CLIP, GROK_USCION, GROK_ADAMW = "uScion + spectral clip", "uScion", "AdamW"


def _epochs(rec: dict, name: str) -> dict[int, int]:
    return {r["seed"]: r["epochs_to_target"] for r in summary_runs(rec, name)}


def grokking(records) -> str:
    rec = records("grokking")
    st, summary = rec["settings"], rec["results"]["summary"]
    seeds = summary[next(iter(summary))]["seeds"]
    rows = []
    for name, s in summary.items():
        per_seed = []
        for r in summary_runs(rec, name):
            cell = str(r["epochs_to_target"])
            if not r["reached"]:
                cell += f" (not reached: {r['final_val_acc']:.1%} at epoch {len(r['curve'])})"
            per_seed.append(cell)
        per_epoch = [r["seconds"] / len(r["curve"]) for r in summary_runs(rec, name)]
        rows.append([name, f"{s['median_epochs']:g}", ", ".join(per_seed), f"{s['reached']}/{s['runs']}",
                     span(per_epoch, "{:.2f}")])
    head = ["optimizer", f"median epochs to {st['target']:.0%} val. acc. (cap {st['max_epochs']})",
            f"per seed ({', '.join(map(str, seeds))})", "reached", "time per epoch (s)"]
    lines = table(head, rows)
    lines += ["", f"`{rec['command']}`: {plural(len(seeds), 'seed')}, {duration(rec['seconds_total'])} for the whole "
                  f"command{made_text(rec)}. Time per epoch: "
                  + ("each seed's mean, min–max over the seeds" if len(seeds) > 1 else "the run's mean")
                  + f" (every epoch is the same work), on {machine_text(rec)}."]
    return "\n".join(lines)


def _reached(rec: dict, name: str) -> list[int]:
    return [r["epochs_to_target"] for r in summary_runs(rec, name) if r["reached"]]


def grokking_clip_epochs(records) -> str:
    rec = records("grokking")
    s = rec["results"]["summary"][GROK_CLIP]
    if s["reached"] != s["runs"]:
        raise Stale("spectral-ball clipping no longer groks on every seed")
    return f"{span(s['epochs'], '{:d}')} epochs (median {s['median_epochs']:g})"


def grokking_uscion_epochs(records) -> str:
    rec = records("grokking")
    s = rec["results"]["summary"][GROK_USCION]
    reached = _reached(rec, GROK_USCION)
    if s["reached"] == s["runs"] or not reached:
        raise Stale("uScion now groks on every seed, or on none")
    return f"median {s['median_epochs']:g}; {span(reached, '{:d}')} on the seeds that grok"


def grokking_uscion_miss(records) -> str:
    rec = records("grokking")
    missed = [r for r in summary_runs(rec, GROK_USCION) if not r["reached"]]
    if not missed or any(r["final_train_acc"] < 0.9 for r in missed):
        raise Stale("the uScion seeds that miss the target no longer all fit the training set")
    seeds = ", ".join(str(r["seed"]) for r in missed)
    train = ", ".join(f"{r['final_train_acc']:.0%}" for r in missed)
    val = ", ".join(f"{r['final_val_acc']:.0%}" for r in missed)
    cap = rec["settings"]["max_epochs"]
    if len(missed) == 1:
        return f"seed {seeds} fits the training set ({train}) but still has only {val} validation accuracy at the {cap}-epoch cap"
    return f"seeds {seeds} fit the training set ({train}) but still have only {val} validation accuracy at the {cap}-epoch cap"


def grokking_adamw_epochs(records) -> str:
    rec = records("grokking")
    s = rec["results"]["summary"][GROK_ADAMW]
    if s["reached"] != s["runs"]:
        raise Stale("AdamW no longer groks on every seed")
    return f"median {s['median_epochs']:g}, {span(s['epochs'], '{:d}')}"


def _wins(rec: dict, a: str, *others: str) -> tuple[int, int]:
    ea, eo = _epochs(rec, a), [_epochs(rec, o) for o in others]
    return sum(all(ea[seed] < e[seed] for e in eo) for seed in ea), len(ea)


def grokking_clip_wins(records) -> str:
    k, n = _wins(records("grokking"), GROK_CLIP, GROK_USCION, GROK_ADAMW)
    return "every seed" if k == n else f"{k} of {n} seeds"


def grokking_uscion_wins(records) -> str:
    k, n = _wins(records("grokking"), GROK_USCION, GROK_ADAMW)
    return f"{k} of {n} seeds"


def grokking_commit(records) -> str | None:
    src = records("grokking").get("source")
    if not src:
        return None  # recorded before records named their commit: left as written
    return src["commit"] + (" (with uncommitted changes)" if src.get("dirty") else "")


# ---------------------------------------------------------------- digits

DIGITS_NAMES = {"+ Frobenius (Euclidean proj.)": "+ Frobenius ball, Euclidean projection (heuristic)",
                "+ Frobenius (anisotropic prox)": "+ Frobenius ball, exact anisotropic prox"}


def spec_name(path: str) -> str:
    """A spec's path as recorded (``specs/…``; ``geomopt/specs/…`` while the specs lived inside the
    package), relative to the shipped specs' folder."""
    return path.removeprefix("geomopt/").removeprefix("specs/")


def spec_cell(path: str | None) -> str:
    return f"`{spec_name(path)}`" if path else "–"


def digits_cnn(records) -> str:
    rec = records("digits_cnn")
    st, summary = rec["settings"], rec["results"]["summary"]
    rows = []
    for name, s in summary.items():
        times = [r["seconds"] for r in summary_runs(rec, name)]
        rows.append([DIGITS_NAMES.get(name, name), spec_cell(s["spec"]), f"{100 * s['mean']:.2f} ± {100 * s['std']:.2f} %",
                     span(times, "{:.1f}")])
    tf = round(100 * st["test_fraction"])
    n = len(st["seed_list"])
    lines = table(["optimizer", "spec", "test accuracy (mean ± std)", "time per seed (s)"], rows)
    lines += ["", f"`{rec['command']}`: {plural(n, 'seed')}, {plural(st['epochs'], 'epoch')}, stratified {100 - tf}/{tf} "
                  f"split; {duration(rec['seconds_total'])} for the whole command{made_text(rec)}. Time per seed: "
                  + ("one run" if n == 1 else f"min–max over the {n} seeds (each the same work)")
                  + f", on {machine_text(rec)}."]
    return "\n".join(lines)


def digits_acc_range(records) -> str:
    means = [s["mean"] for s in records("digits_cnn")["results"]["summary"].values()]
    return f"{100 * min(means):.1f}–{100 * max(means):.1f}%"


def _cost(rec: dict, slow: str, base: str) -> str:
    s = rec["results"]["summary"]
    return f"{s[slow]['seconds'] / s[base]['seconds']:.1f}×"


def digits_prox_cost(records) -> str:
    return _cost(records("digits_cnn"), "+ Frobenius (anisotropic prox)", "uScion")


# ---------------------------------------------------------------- learned metric (SOAP, Muon, AdamW)


def _final_loss(s: dict) -> str:
    """An optimizer's final validation loss in a char_gpt.py record's summary: the mean, ± the
    standard deviation where there are several seeds."""
    return f"{s['mean_final_val']:.3f}" + (f" ± {s['std_final_val']:.3f}" if len(s["final_val"]) > 1 else "")


def _run_times(s: dict) -> list:
    """The timed runs of an optimizer's training in a char_gpt.py record's summary."""
    return s.get("seconds_per_run") or [s["seconds"]]


def learned_metric(records) -> str:
    """examples/learned_metric.py: each optimizer's final validation loss over the seeds."""
    rec = records("learned_metric")
    st, summary = rec["settings"], rec["results"]["summary"]
    rows, runs = [], 1
    for name, s in summary.items():
        times = _run_times(s)
        runs = len(times)
        rows.append([name, spec_cell(s["spec"]), _final_loss(s), ", ".join(f"{v:.3f}" for v in s["final_val"]),
                     f"{s['bits_per_byte']:.2f}", span(times)])
    head = ["optimizer", "spec", "final val. loss (nats/byte)" + (" (mean ± std)" if st["seeds"] > 1 else ""),
            "per seed", "bits/byte", "time (s)"]
    lines = table(head, rows)
    lines += ["", f"`{rec['command']}`: {st['steps']} steps, {plural(st['seeds'], 'seed')} (each optimizer from the "
                  f"same weights and batches at a seed); {duration(rec['seconds_total'])} for the whole command"
                  f"{made_text(rec)}. Time: {repeat_text(runs)}, on {machine_text(rec)}." + differ_text(rec)]
    return "\n".join(lines)


# ---------------------------------------------------------------- char_gpt

CHAR_NAMES = {"prox Frobenius 0.5ρ": "prox Frobenius ball, 0.5ρ (paper's setting)",
              "prox Frobenius 4ρ": "prox Frobenius ball, 4ρ"}
CHAR_USCION, CHAR_PROX, CHAR_R4 = "uScion", "prox Frobenius 0.5ρ", "prox Frobenius 4ρ"


def _fro(rec: dict, name: str) -> list[float]:
    return [v["fro_over_rho"] for r in summary_runs(rec, name) for v in r["norms"].values()]


def char_gpt(records) -> str:
    rec = records("char_gpt")
    st, summary = rec["settings"], rec["results"]["summary"]
    rows, runs = [], 1
    for name, s in summary.items():
        fro = _fro(rec, name)
        times = _run_times(s)
        runs = len(times)
        rows.append([CHAR_NAMES.get(name, name), spec_cell(s["spec"]), _final_loss(s), f"{s['bits_per_byte']:.2f}",
                     span(fro, "{:.2f}" if max(fro) < 5 else "{:.1f}"), span(times)])
    head = ["optimizer", "spec", "final val. loss (nats/byte)" + (" (mean ± std)" if st["seeds"] > 1 else ""),
            "bits/byte", "final ‖W‖_F/ρ (hidden)", "time (s)"]
    lines = table(head, rows)
    lines += ["", f"`{rec['command']}`: {st['steps']} steps, {plural(st['seeds'], 'seed')}; "
                  f"{duration(rec['seconds_total'])} for the whole command{made_text(rec)}. "
                  f"Time: {repeat_text(runs)}, on {machine_text(rec)}." + differ_text(rec)]
    return "\n".join(lines)


def char_uscion_norms(records) -> str:
    fro = _fro(records("char_gpt"), CHAR_USCION)
    return f"{span(fro, '{:.0f}')}ρ"


def _val(rec: dict, name: str) -> float:
    return rec["results"]["summary"][name]["mean_final_val"]


def char_prox_vs_uscion(records) -> str:
    rec = records("char_gpt")
    return f"{_val(rec, CHAR_PROX):.2f} vs {_val(rec, CHAR_USCION):.2f}"


def char_r4_vs_uscion(records) -> str:
    rec = records("char_gpt")
    return f"{_val(rec, CHAR_R4):.3f} vs {_val(rec, CHAR_USCION):.3f}"


def char_prox_cost(records) -> str:
    return _cost(records("char_gpt"), CHAR_PROX, CHAR_USCION)


def char_prox_fallbacks(records) -> str:
    n = sum((r["fallbacks"] or {}).get("hidden") or 0 for r in summary_runs(records("char_gpt"), CHAR_PROX))
    return plural(n, "hidden step")


# ---------------------------------------------------------------- moe


def moe_routing(records) -> str:
    rows = [[f"`{r['parameter']}`", r["shape"], r["role"], r["rule"], r["geometry"], r["view"]]
            for r in records("moe")["routing"]]
    return "\n".join(table(["parameter", "shape", "role", "rule", "geometry", "view"], rows))


def moe(records) -> str:
    rec = records("moe")
    st = rec["settings"]
    rows, runs = [], 1
    for s in rec["results"]["summary"].values():
        times = s.get("seconds_runs") or [s["seconds"]]
        runs = len(times)
        describe = re.sub(r"`(?:geomopt/)?specs/", "`", s["describe"])
        rows.append([describe, f"{s['final_val']:.3f}", f"{s['best_val']:.3f}", f"{s['bits_per_byte']:.2f}",
                     span(times)])
    lines = table(["optimizer", "final val. loss (nats/byte)", "best val. loss", "bits/byte", "time (s)"], rows)
    note = f"Newton–Schulz in {st['ns_dtype_used']} (muon.yaml's dtype auto on {st['device']})"
    lines += ["", f"`{rec['command']}`: {st['steps']} steps per optimizer, seed {st['seed']}; "
                  f"{duration(rec['seconds_total'])} of training{made_text(rec)}, transformers {st['transformers']}. "
                  f"Time: {repeat_text(runs)}, on {machine_text(rec)}. {note}." + differ_text(rec)]
    return "\n".join(lines)


# ---------------------------------------------------------------- catalogue

CATALOG_RESULTS = ROOT / "benchmarks" / "results" / "catalog.json"


def sci(x: float) -> str:
    """A relative difference: ``0`` (bit for bit), else two digits, ``5.8e-6``."""
    if x == 0:
        return "0"
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


CATALOG_MODELS = {"gpt": "GPT", "gpt-clip": "GPT, hidden ×40", "llama": "HF Llama",
                  "mla-clip": "HF DeepSeek-V3 (MLA), q/k ×70"}


def catalog(records) -> str:
    """The catalogue table; a row whose LM-loss figure is far above its same-gradients one (two
    runs that drift apart, not a mismatch) gets a numbered note with the record's reason."""
    rec = records("catalog", CATALOG_RESULTS)
    rows, notes = [], []
    for c in rec["cases"]:
        paper = f"[{c['paper']}]({c['url']})" if c.get("url") else c["paper"]
        same, loss = c["modes"]["same"], c["modes"]["loss"]
        loss_cell = sci(loss["max_rel"]) + (" (bit for bit)" if loss["max_rel"] == 0 else "")
        if loss["max_rel"] > 1e-3 and loss["max_rel"] > 100 * same["max_rel"]:
            notes.append(f"{c['optimizer']}: {loss['why']}.")
            loss_cell += f" ({len(notes)})"
        rows.append([c["optimizer"], f"`{spec_name(c['spec'])}`", paper, f"{c['kind']}: {c['reference']}",
                     CATALOG_MODELS.get(c["model"], c["model"]), c["steps"],
                     sci(same["max_rel"]) + (" (bit for bit)" if same["max_rel"] == 0 else ""), loss_cell])
    head = ["optimizer", "spec", "paper", "reference", "model", "steps", "max rel. diff., same gradients",
            "max rel. diff., LM loss"]
    lines = table(head, rows)
    v = rec.get("versions") or {}
    pkgs = ", ".join(f"{k} {v[k]}" for k in ("pytorch-optimizer", "lion-pytorch", "transformers") if v.get(k))
    lines += ["", f"`{rec['command']}`: {plural(len(rec['cases']), 'spec')}, {duration(rec['seconds_total'])} for the "
                  f"whole command{made_text(rec)}, on {machine_text(rec)}; {pkgs}. Relative difference: the largest, "
                  f"over the model's tensors, of ‖X_geomopt − X_ref‖_F / ‖X_ref − X₀‖_F after the steps; \"same "
                  f"gradients\": both optimizers get the same standard-normal gradients every step, \"LM loss\": each "
                  f"model the gradient of its own next-token loss on the step's fixed batch."]
    lines += [f"({i}) {note}" for i, note in enumerate(notes, 1)]
    return "\n\n".join(["\n".join(lines[:len(rows) + 2]), *lines[len(rows) + 3:]])


# ---------------------------------------------------------------- distributed layouts

LAYOUT_RESULTS = ROOT / "benchmarks" / "results" / "layouts.json"
LAYOUT_NAMES = {"single": "one process", "ddp": "DDP ×2", "fsdp": "FSDP2 ×2", "hsdp": "HSDP 2×2 (Replicate, Shard)",
                "fsdp_tp": "FSDP2 × TP 2×2", "hsdp_tp": "HSDP × TP 2×2×2", "fsdp_ep": "FSDP2 + EP 2×2 (experts whole)",
                "fsdp_ep_rows": "FSDP2 + EP 2×2 (experts' rows cut; muon, mixed, staged)", "pp_fsdp": "PP 2 × FSDP2 2"}


def layouts(records) -> str:
    """Per layout: the deviation from one process over every spec of the layout matrix, and each
    benchmarked spec's bytes sent per rank in a step (÷ parameter bytes) and step time; a layout
    the width benchmark does not step (its own model) shows the matrix run's bytes, marked ᵐ."""
    rec = records("layouts", LAYOUT_RESULTS)
    specs = list(next(iter(rec["cost"].values())))
    rows = []
    for layout in [*rec["cost"], *(k for k in rec["deviation"] if k not in rec["cost"])]:
        d = rec["deviation"].get(layout)
        dev = "—" if d is None else sci(d["max_rel"]) + (" (bit for bit)" if d["max_rel"] == 0 else "")
        by_spec = rec["cost"].get(layout)
        if by_spec is not None:
            cells = [f"{max(r['sent'] for r in by_spec[s]):.2f}×, {span([r['step_ms'] for r in by_spec[s]])} ms"
                     for s in specs]
        else:
            cells = [f"{d['sent'][s]:.2f}×ᵐ" if s in d["sent"] else "—" for s in specs]
        processes = 1 if layout == "single" else (d or {}).get("processes", 4)
        rows.append([LAYOUT_NAMES.get(layout, layout), str(processes), dev, *cells])
    n = max(d["specs"] for d in rec["deviation"].values())
    head = ["layout", "processes", f"deviation from one process (≤ {n} specs)", *(f"`{s}`: sent, step" for s in specs)]
    caption = (f"`{rec['command']}`{made_text(rec)}, gloo processes on {machine_text(rec)}. Deviation: the "
               f"largest, over every shipped spec and two that use every operator locality and post-stage, of "
               f"max over tensors ‖X − X₁‖_F / ‖X₁‖_F after 2 steps (tests/test_layouts*.py, "
               f"tests/test_expert_parallel.py and tests/test_pipeline_parallel.py assert it). Sent: the bytes a "
               f"rank hands to collectives in one optimizer step (ring all-reduce 2(w−1)/w·n, all-gather (w−1)·n, "
               f"all-to-all what leaves the rank), largest over ranks, ÷ the parameter bytes of an HF Llama of "
               f"width {rec['width']} ({rec['param_mb']:.1f} MiB); ᵐ: on the layout matrix's own model, not "
               f"timed; —: not run there; step: the step's median time, min–max over ranks (the processes share 2 "
               f"cores). PP's gradients are sums over 2 microbatches, which alone account for most of its deviation "
               f"from one process's whole-batch backward (tests/test_pipeline_parallel.py tells the two apart).")
    return "\n".join(table(head, rows)) + "\n\n" + caption


def catalog_names(records) -> str:
    """The catalogue by name, one sentence: each shipped name and the optimizer it is."""
    rec = records("catalog", CATALOG_RESULTS)
    return ", ".join(f"`{Path(c['spec']).stem}` ({c['optimizer']})" for c in rec["cases"])


# ---------------------------------------------------------------- fuzzing

FUZZ_RESULTS = ROOT / "benchmarks" / "results" / "fuzz.json"


def _count(n: int) -> str:
    return f"{n:,}"


def fuzz(records) -> str:
    """Per kind of untrusted input (mutated specs, mutated checkpoints): how many mutants, how many
    were accepted and stepped to finite values, refused with geomopt's own error, and the rest,
    the findings (any other exception, a hang, a refusal that changed something, non-finite values)."""
    rec = records("fuzz", FUZZ_RESULTS)
    rows = []
    if rec.get("n"):
        out = rec["outcomes"]
        refused = {k: out.get(f"{k}_refused", 0) for k in ("parse", "compile", "build")}
        asked = out.get("overflow_asked", 0)
        allowed = out.get("stepped", 0) + sum(refused.values()) + asked
        rows.append(["specs, YAML and DSL (`tests/fuzz_pipeline.py`)", _count(rec["n"]), _count(out.get("stepped", 0)),
                     f"{_count(sum(refused.values()))} (parse {_count(refused['parse'])}, compile "
                     f"{_count(refused['compile'])}, build {_count(refused['build'])})",
                     _count(rec["n"] - allowed), f"{rec['mutants_per_s']:.0f}"])
    points = rec.get("checkpoints")
    if points:
        out = points["outcomes"]
        rows.append(["optimizer checkpoints (`tests/fuzz_checkpoints.py`)", _count(points["n"]),
                     _count(out.get("stepped", 0)), _count(out.get("refused", 0)),
                     _count(points["n"] - out.get("stepped", 0) - out.get("refused", 0)),
                     f"{points['mutants_per_s']:.0f}"])
    head = ["mutated input", "mutants", "accepted, stepped to finite values", "refused with geomopt's error",
            "findings", "mutants/s"]
    command = (f"python scripts/fuzz.py --n {rec.get('n', 0)} --checkpoints {(points or {}).get('n', 0)} "
               f"--seed {rec.get('seed', (points or {}).get('seed'))} --workers {rec['workers']}")
    spec_note = (f" A spec mutant counts as stepped when two steps on finite gradients left its model finite and "
                 f"a step with a NaN gradient changed nothing; {_count(rec['outcomes'].get('overflow_asked', 0))} "
                 f"more held a number above 10⁶ and overflowed as asked (not counted as findings)."
                 if rec.get("n") else "")
    again = rec.get("recheck")
    recheck = (f" Rechecked on geomopt {again['commit']} (`--recheck`): {len(again['still_findings'])} of the "
               f"{again['n']} findings remain." if again else "")
    caption = (f"`{command}`, geomopt {rec['commit']}, {plural(rec['workers'], 'worker')}. Findings: any other "
               f"exception (a traceback), a mutant running past 60 s, a refusal that changed the model, the "
               f"parameters or the optimizer's state (compared bit for bit), a refusal of a checkpoint naming "
               f"nothing it mutated, non-finite values after a step on finite gradients; the file lists each "
               f"(`findings`, `checkpoints.findings`), replayed alone by `--replay SEED:I` or "
               f"`--replay-checkpoint SEED:I`.{recheck}{spec_note}")
    return "\n".join(table(head, rows)) + "\n\n" + caption


# ---------------------------------------------------------------- mutation testing

MUTATION_RESULTS = ROOT / "benchmarks" / "results" / "mutation.json"
MUTATION_GROUPS = {"geometry": "`geomopt/geometry/`", "stages": "`geomopt/optim/units/stages.py`",
                   "directions": "`geomopt/optim/units/directions.py`",
                   "compensation": "`geomopt/optim/units/compensation.py`"}


def mutation(records) -> str:
    """Per group of modules (scripts/mutate.py): mutants, killed, timed out, survived (of them
    explained), and the score, with and without the explained survivors."""
    rec = records("mutation", MUTATION_RESULTS)

    rows = [[MUTATION_GROUPS.get(g, g), str(c["mutants"]), str(c["killed"]), str(c["timed_out"]),
             f"{c['survived']} ({c['explained']})", _mutation_pct(c, c["survived"]),
             _mutation_pct(c, c["survived"] - c["explained"])]
            for g, c in rec["groups"].items()]
    head = ["modules", "mutants", "killed", "timed out", "survived (explained)", "score",
            "score, explained survivors left out"]
    sample = rec["sample"]
    drawn = (f"a seeded sample of {sample['mutants']} of the {sample['of']} mutants (seed {sample['seed']})"
             if sample["sampled"] else f"all {sample['of']} mutants")
    if sample.get("stopped_after") is not None and sample["sampled"]:
        drawn += (f": the first {sample['mutants']} of them in a seeded random order, the run stopping after "
                  f"{duration(sample['stopped_after'])}")
    load = f", load average {rec['load'][0]:.1f} as it began" if rec.get("load") else ""
    own = rec.get("own_tests_in_full", False)  # records before it capped every file
    runs = (f"the tests that call its function: all of those of its module's own test files, at most "
            f"{rec['tests_per_file']} of each other test file" if own else
            f"at most {rec['tests_per_file']} of the tests of each test file that call its function")
    caption = (f"`{rec['command']}`{made_text(rec)}: {drawn}, {plural(rec['workers'], 'worker')}, "
               f"{duration(rec['seconds'])} on {machine_text(rec)}{load}; each mutant runs {runs}. Score: "
               f"(killed + timed out) / (killed + timed out + survived); a survivor is explained where it is "
               f"equivalent to the original or no test can tell it apart (the outcome file, "
               f"`benchmarks/results/mutation.json`, says why).")
    for r in rec.get("reruns", []):
        caption += (f" Its unexplained survivors ran again after tests were added (`--rerun-survivors`{made_text(r)}): "
                    f"{r['killed']} of {r['mutants']} killed; the table counts them killed.")
    return "\n".join(table(head, rows)) + "\n\n" + caption


MUTATION_MODULES = ROOT / "benchmarks" / "results" / "mutation_modules.json"


def mutation_modules(records) -> str:
    """Per module run in full (scripts/mutate.py ``--per-module``): its mutants, killed, timed out,
    survived (of them explained), the score with and without the explained survivors, and the run."""
    rec = records("mutation_modules", MUTATION_MODULES)
    rows, notes = [], []
    for path, run in rec["modules"].items():
        c = dict(run["modules"][path])
        rows.append([f"`{path}`", str(c["mutants"]), str(c["killed"]), str(c["timed_out"]),
                     f"{c['survived']} ({c['explained']})", _mutation_pct(c, c["survived"]),
                     _mutation_pct(c, c["survived"] - c["explained"])])
        note = (f"`{path}`: `{run['command']}`{made_text(run)}, {plural(run['workers'], 'worker')}, its mutants "
                f"{duration(run['seconds'])} on {machine_text(run)}")
        if run.get("load"):
            note += f", load average {run['load'][0]:.1f} as it began"
        for r in run.get("reruns", []):
            note += (f"; its unexplained survivors ran again after tests were added (`--rerun-survivors`"
                     f"{made_text(r)}): {r['killed']} of {r['mutants']} killed, counted killed")
        notes.append(note + ".")
    head = ["module", "mutants", "killed", "timed out", "survived (explained)", "score",
            "score, explained survivors left out"]
    per_file = {run["tests_per_file"] for run in rec["modules"].values()}
    caption = (f"Every mutant of each module, each running the tests that call its function: all of those of "
               f"the module's own test files, at most {'/'.join(map(str, sorted(per_file)))} of each other test "
               f"file (the outcome file, `benchmarks/results/mutation_modules.json`, lists each survivor and why "
               f"it is explained). " + " ".join(notes))
    return "\n".join(table(head, rows)) + "\n\n" + caption


def _mutation_pct(c: dict, survived: int) -> str:
    """(killed + timed out) / (killed + timed out + ``survived``) of the counts ``c``, as a percentage: from
    the counts (the records' scores are rounded)."""
    caught = c["killed"] + c["timed_out"]
    return "—" if caught + survived == 0 else f"{100 * caught / (caught + survived):.1f}%"


# ---------------------------------------------------------------- benchmarks/RESULTS.md, quoted

HEADING = re.compile(r"^(#{2,6}) (.+?)\s*$")

#: key → (a regular expression a section's heading must match, how many of the matching sections
#: to quote: the last ``n`` in the file, in file order). A quote copies the sections verbatim (their
#: tables, captions and notes), under their headings set in bold, so a page quoting them says
#: only what the log says.
BENCH_QUOTES = {
    "compile": (r"Compile$", 1),
    "step-cpu": (r"gpt-bench on x86_64 CPU, 2 threads — .*8 hidden matrices", 1),
    "step-cpu-width": (r"gpt-bench-w[24] on x86_64 CPU", 2),
    "step-ddp": (r"gpt-bench, DDP on x86_64 CPU", 1),
    "layouts": (r"Layouts on 4 (and 8 )?gloo processes", 1),
    "step-gpu-first": (r"All shipped specs on NVIDIA", 1),
    "step-gpu": (r"Optimizer step on NVIDIA H100 80GB HBM3", 1),
    "cuda-graphs": (r"CUDA graphs", 1),
    "capture": (r"Whole-step CUDA graph", 1),
    "backward-gpu": (r"Exact backward steps and SVD-free constraints on", 1),
    "backward-cpu": (r"backward steps, 16 × 256×128 fp32", 1),
    "svd-free-cpu": (r"SVD-free steps, gpt-bench on x86_64 CPU", 1),
    "experts": (r"MoE experts", 1),
    "dtype": (r"Newton–Schulz dtype", 1),
    "memory": (r"Optimizer-held memory", 4),
    "memory-peak": (r"Optimizer-held memory: .*, 1 threads,", 2),
    "traffic": (r"Step traffic against the floor, GPT-2-small's", 1),
    "state-quality": (r"State precision and quality: \w+'s training", 3),
    "state-cost": (r"State precision's step time and bytes", 1),
    "state-update-error": (r"State round trip and the next update", 2),
    "weight-quality": (r"Low-precision weights and quality: \w+'s training", 2),
    "elementwise": (r"Elementwise steps", 2),
    "gram-ns": (r"newton_schulz vs gram_newton_schulz", 1),
    "dion": (r"Dion vs Muon", 1),
    "stages": (r"Post-stages", 2),
    "lint": (r"geomopt lint \(no model\)", 1),
    "suite": (r"Test suite", 1),
}
#: quotes that keep their subsections (the others end at the next heading of any level)
BENCH_WITH_SUBSECTIONS = {"cuda-graphs"}


def bench_sections(text: str, subsections: bool = False) -> list[tuple[int, str, list[str]]]:
    """(level, heading, body lines) of every section of RESULTS.md: to the next heading, or with
    ``subsections`` to the next heading of its level or above."""
    lines = text.splitlines()
    heads = [(i, len(m[1]), m[2]) for i, line in enumerate(lines) if (m := HEADING.match(line))]
    out = []
    for k, (i, level, title) in enumerate(heads):
        end = next((j for j, lv, _ in heads[k + 1:] if lv <= level or not subsections), len(lines))
        out.append((level, title, lines[i + 1:end]))
    return out


def bench_quote(key: str):
    pattern, count = BENCH_QUOTES[key]

    def render(records) -> str:
        text = BENCH_RESULTS.read_text(encoding="utf-8")
        sections = [s for s in bench_sections(text, key in BENCH_WITH_SUBSECTIONS) if re.search(pattern, s[1])]
        if len(sections) < count:
            raise Stale(f"benchmarks/RESULTS.md has {len(sections)} section(s) headed like {pattern!r}, the page quotes {count}")
        parts = []
        for _, title, body in sections[-count:]:
            body = [f"**{m[2]}**" if (m := HEADING.match(line)) else line for line in body]
            text = "\n".join(body).strip()
            text = re.sub(r"\n{3,}", "\n\n", text)
            text = re.sub(r"(?m)^(\|.*\|)\n(?=[^|\n])", r"\1\n\n", text)  # a table ends before its caption
            parts.append(f"**{title}** (`benchmarks/RESULTS.md`)\n\n{text}")
        return "\n\n".join(parts)

    render.__name__ = f"bench_{key.replace('-', '_')}"
    return render


RENDERERS = {
    "demo": demo,
    "busy": busy,
    "busy:line": busy_line,
    "moe-routing": moe_routing,
    "moe": moe,
    "grokking": grokking,
    "grokking:clip-epochs": grokking_clip_epochs,
    "grokking:uscion-epochs": grokking_uscion_epochs,
    "grokking:uscion-miss": grokking_uscion_miss,
    "grokking:adamw-epochs": grokking_adamw_epochs,
    "grokking:clip-wins": grokking_clip_wins,
    "grokking:uscion-wins": grokking_uscion_wins,
    "grokking:commit": grokking_commit,
    "digits_cnn": digits_cnn,
    "digits_cnn:acc-range": digits_acc_range,
    "digits_cnn:prox-cost": digits_prox_cost,
    "char_gpt": char_gpt,
    "learned_metric": learned_metric,
    "char_gpt:uscion-norms": char_uscion_norms,
    "char_gpt:prox-vs-uscion": char_prox_vs_uscion,
    "char_gpt:r4-vs-uscion": char_r4_vs_uscion,
    "char_gpt:prox-cost": char_prox_cost,
    "char_gpt:prox-fallbacks": char_prox_fallbacks,
    "catalog": catalog,
    "catalog:names": catalog_names,
    "layouts": layouts,
    "layouts:docs": layouts,
    "fuzz": fuzz,
    "mutation": mutation,
    "mutation-modules": mutation_modules,
    **{f"bench:{key}": bench_quote(key) for key in BENCH_QUOTES},
}


# ---------------------------------------------------------------- README and docs


def targets(readme: Path = README, docs: Path = DOCS) -> list[Path]:
    """The files whose marked parts are generated: the README and every page under docs/."""
    pages = sorted(p for p in docs.rglob("*.md") if "hooks" not in p.relative_to(docs).parts) if docs.is_dir() else []
    return [readme, *pages]


def _name(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def regenerate(text: str, records) -> tuple[str, list[str]]:
    """``text`` with every marked part rendered from ``records``, and the problems found (unknown
    keys, missing JSON, sentences that no longer fit)."""
    problems = []

    def sub(m: re.Match) -> str:
        key, body = m["key"], m["body"]
        fn = RENDERERS.get(key)
        if fn is None:
            problems.append(f"unknown key {key!r} (known: {', '.join(RENDERERS)})")
            return m[0]
        try:
            value = fn(records)
        except Stale as exc:
            problems.append(f"{key}: {exc}: rewrite the sentence around this key")
            return m[0]
        except Unusable as exc:
            problems.append(f"{key}: {exc}")
            return m[0]
        except (OSError, KeyError, ValueError, TypeError) as exc:
            problems.append(f"{key}: cannot render from the results ({type(exc).__name__}: {exc})")
            return m[0]
        if value is None:
            return m[0]
        if "\n" in body:  # a block: keep the markers on lines of their own
            value = f"\n{value}\n"
        elif "\n" in value:
            problems.append(f"{key}: a block renderer used inside a sentence")
            return m[0]
        return f"<!-- results:{key} -->{value}<!-- /results -->"

    return MARKER.sub(sub, text), problems


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 (with a diff) where a file disagrees with the results")
    mode.add_argument("--print", action="store_true", help="print every key's rendering instead of touching the files")
    ap.add_argument("--readme", type=Path, default=README, help="the README to check or rewrite (default: README.md)")
    ap.add_argument("--docs", type=Path, default=DOCS, help="the documentation folder to check or rewrite (default: docs/)")
    ap.add_argument("--results", type=Path, default=RESULTS,
                    help="folder of the results JSON (default: examples/results/; another folder only with --print)")
    args = ap.parse_args(argv)
    committed = args.results.resolve() == RESULTS.resolve()
    if not committed and not args.print:
        ap.error("the README and the docs quote the committed results: --results DIR is for --print only")
    records = Records(args.results, committed)
    if args.print:
        for key, fn in RENDERERS.items():
            try:
                value = fn(records)
            except FileNotFoundError:
                continue  # a run folder holds one experiment's JSON
            except (Stale, Unusable) as exc:
                value = f"(cannot render: {exc})"
            print(f"<!-- results:{key} -->" + ("(left as written)" if value is None else
                  f"\n{value}\n" if "\n" in value else value) + "<!-- /results -->")
        return 0
    files = targets(args.readme, args.docs)
    seen: dict[str, list[str]] = {}
    problems, changed = [], []
    for path in files:
        text = path.read_text(encoding="utf-8")
        for m in MARKER.finditer(text):
            seen.setdefault(m["key"], []).append(_name(path))
        new, found = regenerate(text, records)
        problems += [f"{_name(path)}: {p}" for p in found]
        if new != text:
            changed.append((path, text, new))
    missing = [k for k in RENDERERS if k not in seen]
    if missing:
        problems.append(f"keys without a marker in {', '.join(_name(p) for p in files[:1])} or docs/: {', '.join(missing)}")
    twice = {k: where for k, where in seen.items() if len(where) > 1}
    for key, where in twice.items():
        problems.append(f"key {key!r} is marked {len(where)} times ({', '.join(where)}): mark each key once")
    for p in problems:
        print(p, file=sys.stderr)
    if args.check:
        for path, text, new in changed:
            name = _name(path)
            sys.stdout.writelines(difflib.unified_diff(text.splitlines(True), new.splitlines(True),
                                                       f"{name} (as is)", f"{name} (from results)"))
            print(f"{name} disagrees with the results: run python scripts/readme_tables.py", file=sys.stderr)
        return 1 if changed or problems else 0
    for path, text, new in changed:
        path.write_text(new, encoding="utf-8")
        print(f"rewrote {sum(a != b for a, b in zip(MARKER.findall(text), MARKER.findall(new)))} marked part(s) "
              f"of {_name(path)}")
    if not changed:
        print(f"{', '.join(_name(p) for p in files[:1])} and docs/ already agree with the results")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
