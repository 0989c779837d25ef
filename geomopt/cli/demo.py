"""``geomopt demo``: lint a shipped spec against a built-in GPT, show the plan, train it on text
that ships with Python (byte level), compare with AdamW, print a table and write a plot.

Output convention, shared with the scripts in ``examples/``: a run writes its JSON and PNG to the
folder ``--out`` (default ``runs/<name>/`` under the current directory; ``runs/`` is git-ignored),
so running it never changes a checkout. ``--record`` is record mode: it rewrites the committed
results in ``examples/results/`` of a source checkout (or ``--out``), times each training run
``--repeats`` times (default 3) and records the machine, for the README's tables
(``scripts/readme_tables.py``)."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sysconfig
import time
from pathlib import Path

import geomopt
from geomopt.cli.status import EXIT_CLEAN, EXIT_FINDINGS, UsageError
from geomopt.cli.threads import add_threads_arg, choose_threads, training_step
from geomopt.compile.compiler import model_params
from geomopt.lint.reporters import report
from geomopt.lint.runner import lint_spec
from geomopt.spec.shipped import shipped_folder

SPECS_DIR = shipped_folder("specs")
REPO = Path(__file__).resolve().parents[2]  # the source checkout, when geomopt runs from one
RESULTS_DIR = REPO / "examples" / "results"  # the committed results the README quotes
RUNS = Path("runs")  # default output root, relative to the current directory (git-ignored)
RECORD_REPEATS = 3  # timed runs per training in record mode


def output_dir(out: str | None, record: bool, name: str, results: Path = RESULTS_DIR) -> Path:
    """Where a run named ``name`` writes: ``out`` if given, else the committed ``results`` folder
    (examples/results/) in record mode, else ``runs/<name>/``. The committed results are
    rewritten only in record mode (ValueError otherwise, and when record mode has no source
    checkout to write to)."""
    results = results.resolve()
    if out is None:
        if not record:
            return RUNS / name
        if not results.is_dir():
            raise ValueError(f"--record rewrites examples/results/ of a source checkout, and {results} "
                             "does not exist; pass --out DIR to record elsewhere")
        return results
    path = Path(out)
    if path.suffix.lower() in (".png", ".json"):
        raise ValueError(f"--out {out}: a folder is expected ({name}.json and {name}.png are written into it)")
    resolved = path.resolve()
    if not record and (resolved == results or results in resolved.parents):
        raise ValueError(f"{out} holds the committed results; pass --record to rewrite them")
    return path


def machine(device: str = "cpu") -> dict:
    """What timings were measured on: CPU model, logical cores, torch threads, torch version,
    platform (and the GPU on a CUDA device)."""
    import torch  # torch: off the lint path (a spec alone never loads it)

    cpu = None
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("model name", "Model name", "Hardware")):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = dict(cpu=cpu or platform.processor() or platform.machine() or "unknown", cores=os.cpu_count(),
                threads=torch.get_num_threads(), torch=torch.__version__, python=platform.python_version(),
                platform=platform.platform())
    if str(device).startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info


def source_version(root: Path = REPO) -> dict | None:
    """The checkout's commit, and whether files other than the recorded results (examples/results,
    benchmarks/results, benchmarks/RESULTS.md) and the pages that quote them (README.md, docs/)
    differ from it; None outside a git checkout."""
    if not (root / ".git").exists():
        return None
    git = ["git", "--no-optional-locks", "-C", str(root)]
    try:
        commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=20, check=True).stdout.strip()
        changed = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no", "--", ".",
                                  ":!examples/results", ":!benchmarks/results", ":!benchmarks/RESULTS.md",
                                  ":!README.md", ":!docs"], capture_output=True, text=True,
                                 timeout=20, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return dict(commit=commit, dirty=bool(changed))


def span(values, fmt: str = "{:.0f}") -> str:
    """``min–max`` of ``values`` in ``fmt``, one number where both ends print the same."""
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo}–{hi}"


def corpus_bytes(limit: int = 2_000_000) -> bytes:
    """English prose bundled with CPython: pydoc's topic help texts (else stdlib sources)."""
    try:
        from pydoc_data.topics import topics  # a large data module: only for the demo's corpus

        text = "\n\n".join(topics[k] for k in sorted(topics))
    except ImportError:  # pragma: no cover - distributions that strip pydoc_data

        root = Path(sysconfig.get_paths()["stdlib"])
        text = "\n".join(p.read_text(errors="ignore") for p in sorted(root.glob("*.py"))[:200])
    return text.encode("utf-8", errors="ignore")[:limit]


def batches(data, block: int, batch: int, generator):
    import torch  # torch: off the lint path (a spec alone never loads it)

    while True:
        ix = torch.randint(len(data) - block - 1, (batch,), generator=generator)
        x = torch.stack([data[i : i + block] for i in ix])
        y = torch.stack([data[i + 1 : i + 1 + block] for i in ix])
        yield x, y


def train(make_opt, *, steps: int, seed: int, block: int = 64, batch: int = 32, eval_every: int = 25, label: str = "",
          progress: bool = True, warmup: int = 0, config=None, device: str = "cpu", build=None, loss=None):
    """Train a small byte-level model; returns dict(label, steps, train, val, seconds).

    ``config``: a GPTConfig (default: 2 layers, 4 heads, width 64, context ``block``); ``device``:
    where the model and batches live (the data is sampled on the CPU with the same generator).
    ``build()``: another model (context ``block``), with ``loss(model, x, y)`` → (the loss to
    minimize, the cross-entropy to report); default: the GPT of ``config`` and its loss."""
    import torch  # torch: off the lint path (a spec alone never loads it)

    from geomopt.models.gpt import GPT, GPTConfig  # the models need torch: off the lint path

    torch.manual_seed(seed)
    raw = torch.frombuffer(bytearray(corpus_bytes()), dtype=torch.uint8).long()
    split = int(0.9 * len(raw))
    train_data, val_data = raw[:split], raw[split:]
    if build is None:
        if config is None:
            config = GPTConfig(vocab_size=256, block_size=block, n_layer=2, n_head=4, n_embd=64)
        block = config.block_size
        model = GPT(config).to(device)
    else:
        model = build().to(device)
    if loss is None:
        def loss(m, x, y):
            value = m(x, y)[1]
            return value, value
    opt = make_opt(model)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda k: min(1.0, (k + 1) / warmup) if warmup else 1.0 * (1 - 0.9 * k / steps))
    gen = torch.Generator().manual_seed(seed)
    it = batches(train_data, block, batch, gen)
    val_gen = torch.Generator().manual_seed(seed + 1)
    val_batches = [tuple(t.to(device) for t in next(batches(val_data, block, 64, val_gen))) for _ in range(4)]
    curve_steps, curve_train, curve_val = [], [], []
    bar = None
    if progress:
        try:
            from tqdm import tqdm  # optional: a progress bar

            bar = tqdm(total=steps, desc=label, unit="step", leave=True, dynamic_ncols=True)
        except ImportError:  # tqdm is an optional extra
            bar = None
    start = time.perf_counter()
    running = None
    for k in range(steps):
        x, y = next(it)
        if device != "cpu":
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        total, reported = loss(model, x, y)
        opt.zero_grad(set_to_none=True)
        total.backward()
        opt.step()
        sched.step()
        running = reported.item() if running is None else 0.9 * running + 0.1 * reported.item()
        if (k + 1) % eval_every == 0 or k + 1 == steps:
            model.eval()
            with torch.no_grad():
                val = sum(loss(model, vx, vy)[1].item() for vx, vy in val_batches) / len(val_batches)
            model.train()
            curve_steps.append(k + 1)
            curve_train.append(running)
            curve_val.append(val)
            if bar is not None:
                bar.set_postfix(train=f"{running:.3f}", val=f"{val:.3f}")
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return dict(label=label, steps=curve_steps, train=curve_train, val=curve_val, seconds=time.perf_counter() - start)


def probe_step(make_opt, *, block: int = 64, batch: int = 32, config=None, build=None, loss=None,
               device: str = "cpu"):
    """One training step (forward, backward, ``step``) of a throwaway copy of :func:`train`'s model
    and optimizer on a fixed random batch, as a function: what the thread probe
    (:func:`geomopt.cli.threads.choose_threads`) times. Building it leaves torch's global random
    state as it was."""
    import torch  # torch: off the lint path (a spec alone never loads it)

    from geomopt.models.gpt import GPT, GPTConfig  # the models need torch: off the lint path

    with torch.random.fork_rng(devices=[]):
        if build is None:
            config = config or GPTConfig(vocab_size=256, block_size=block, n_layer=2, n_head=4, n_embd=64)
            block = config.block_size
            model = GPT(config).to(device)
        else:
            model = build().to(device)
        opt = make_opt(model)
        gen = torch.Generator().manual_seed(0)
        x = torch.randint(256, (batch, block), generator=gen).to(device)
        y = torch.randint(256, (batch, block), generator=gen).to(device)
    if loss is None:
        def loss(m, x, y):
            value = m(x, y)[1]
            return value, value
    return training_step(model, opt, lambda m: loss(m, x, y)[0])


def plot(results: list[dict], path: Path, title: str = "byte-level GPT on Python's bundled docs") -> bool:
    try:
        import matplotlib  # optional and heavy: only to plot

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # optional and heavy: only to plot
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for r in results:
        (line,) = ax.plot(r["steps"], r["val"], label=f"{r['label']} (val)")
        ax.plot(r["steps"], r["train"], "--", color=line.get_color(), alpha=0.5, label=f"{r['label']} (train, EMA)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    return save_figure(fig, path)


def save_figure(fig, path: Path, dpi: int = 120) -> bool:
    """Lay out, write (creating the folder) and close a matplotlib figure."""
    import matplotlib.pyplot as plt  # optional and heavy: only to plot

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return True


def run(args) -> int:
    import torch  # torch: off the lint path (a spec alone never loads it)

    from geomopt.models.gpt import GPT, GPTConfig  # the models need torch: off the lint path

    try:
        out = output_dir(args.out, args.record, "demo")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.repeats is not None and args.repeats < 1:
        raise UsageError("--repeats must be at least 1")
    if args.threads is not None and args.threads < 1:
        raise UsageError("--threads must be at least 1")
    spec_path = Path(args.spec)
    spec = geomopt.load_spec(spec_path)
    probe = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64))
    print(f"== lint {spec_path} against the built-in GPT")
    diags = lint_spec(spec, model_params(probe)[0])
    report(diags, "text")
    if any(d.severity == "error" for d in diags):
        return EXIT_FINDINGS
    print("clean" if not diags else f"{len(diags)} finding(s), no errors")
    plan = geomopt.compile_spec(spec, probe)
    print(f"\n== plan of '{spec.name}' ({len(plan)} tensors)")
    rows = plan.summary()
    width = max(len(r["geometry"]) for r in rows)
    for r in rows:
        print(f"  {r['rule']:<12} {r['tensors']:>3} tensors {r['elements']:>8} elements  "
              f"{r['geometry']:<{width}}  {r['constraint']}")
    steps = args.steps or (30 if args.quick else 800)
    repeats = args.repeats or (RECORD_REPEATS if args.record else 1)
    makers = [
        (spec.name, lambda m: geomopt.GeomOptimizer(m, spec)),
        ("AdamW", lambda m: torch.optim.AdamW(m.parameters(), lr=args.adamw_lr, betas=(0.9, 0.95), weight_decay=0.1)),
    ]
    print(f"\n== training {steps} steps per optimizer (seed {args.seed})"
          + (f", {repeats} timed runs each" if repeats > 1 else ""))
    threads = choose_threads(args.threads, lambda: probe_step(makers[0][1]))
    print(threads.header(), flush=True)
    runs: dict[str, list[dict]] = {label: [] for label, _ in makers}
    for k in range(repeats):  # interleaved, so that a change in the machine's load reaches every optimizer
        for label, make in makers:
            r = train(make, steps=steps, seed=args.seed,
                      label=label if repeats == 1 else f"{label} ({k + 1}/{repeats})",
                      eval_every=max(1, steps // 20), progress=not args.no_progress)
            runs[label].append(dict(r, label=label))
    results = []
    for _label, rs in runs.items():  # the curves of the first run; every run's time
        results.append(dict(rs[0], seconds_runs=[r["seconds"] for r in rs],
                            identical=all(r["train"] == rs[0]["train"] and r["val"] == rs[0]["val"] for r in rs)))
    print(f"\n{'optimizer':<22} {'final train':>11} {'final val':>10} {'best val':>9} {'bits/byte':>9} "
          f"{'time (s)':>11}")
    for r in results:
        best = min(r["val"])
        print(f"{r['label']:<22} {r['train'][-1]:>11.4f} {r['val'][-1]:>10.4f} {best:>9.4f} "
              f"{r['val'][-1] / math.log(2):>9.3f} {span(r['seconds_runs'], '{:.1f}'):>11}")
    if not all(r["identical"] for r in results):
        print("note: the repeated runs' losses differ (nondeterministic kernels); the table shows the first run's")
    record = dict(
        command=_command(args), spec=spec.name, steps=steps, seed=args.seed, adamw_lr=args.adamw_lr,
        quick=bool(args.quick), record=bool(args.record), repeats=repeats,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        torch=torch.__version__, threads=torch.get_num_threads(), thread_choice=threads.record(), machine=machine(),
        source=source_version(),
        repeats_identical=all(r["identical"] for r in results),
        results=[dict(label=r["label"], final_val=round(r["val"][-1], 4), best_val=round(min(r["val"]), 4),
                      bits_per_byte=round(r["val"][-1] / math.log(2), 3),
                      seconds=round(statistics.median(r["seconds_runs"]), 1),
                      seconds_runs=[round(t, 1) for t in r["seconds_runs"]]) for r in results])
    summary = out / "demo.json"  # what the README quotes (scripts/readme_tables.py), next to the plot
    summary.parent.mkdir(parents=True, exist_ok=True)
    summary.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    if plot(results, out / "demo.png"):
        print(f"\nwrote {out / 'demo.png'} and {summary}")
    else:
        print(f"\nwrote {summary} (matplotlib is not installed: pip install 'geomopt[examples]' for the plot)")
    return EXIT_CLEAN


def _command(args) -> str:
    """The demo's command line, as far as it changes the numbers."""
    parts = ["geomopt demo"]
    if Path(args.spec).resolve() != (SPECS_DIR / "spectral-clip.yaml").resolve():
        parts.append(f"--spec {args.spec}")
    if args.steps:
        parts.append(f"--steps {args.steps}")
    if args.quick:
        parts.append("--quick")
    if args.seed:
        parts.append(f"--seed {args.seed}")
    if args.adamw_lr != 3e-3:
        parts.append(f"--adamw-lr {args.adamw_lr:g}")
    if args.record:
        parts.append("--record")
    if args.repeats:
        parts.append(f"--repeats {args.repeats}")
    if args.threads:
        parts.append(f"--threads {args.threads}")
    return " ".join(parts)


def add_parser(sub) -> None:
    sp = sub.add_parser("demo", help="lint + plan + a short real training run against AdamW, with a table and a plot")
    sp.add_argument("--spec", default=str(SPECS_DIR / "spectral-clip.yaml"), help="spec file to train with")
    sp.add_argument("--steps", type=int, default=0, help="training steps per optimizer (default 800; 30 with --quick)")
    sp.add_argument("--quick", action="store_true", help="a few steps only (for tests)")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--adamw-lr", type=float, default=3e-3)
    sp.add_argument("--out", metavar="DIR", help="folder for demo.png and demo.json (default: runs/demo/ under the "
                    "current directory; with --record: examples/results/)")
    sp.add_argument("--record", action="store_true", help="record mode: rewrite the committed examples/results/demo.* "
                    f"(or --out), timing each training --repeats times (default {RECORD_REPEATS}), with the machine")
    sp.add_argument("--repeats", type=int, help="timed runs of each training (default 1; "
                    f"{RECORD_REPEATS} with --record); the table shows min–max")
    sp.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_threads_arg(sp)
    sp.set_defaults(fn=run)
