"""The ``geomopt`` command: lint, plan, explain, init, fmt, schema, rule (and demo, bench where installed).

Every SPEC argument is a spec file or a shipped spec's name (``geomopt lint muon``:
:func:`geomopt.spec.extends.shipped_specs`).

Exit status (:mod:`geomopt.cli.status`), as linters do: 0 clean, 1 findings at error level (or
warnings with ``--strict``, roles decided without a trace with ``lint --require-trace``), 2 usage
error or unreadable input. A user mistake never prints a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import re
import sys
from pathlib import Path
from typing import Optional, Sequence

from geomopt.cli.models import load_model
from geomopt.cli.status import EXIT_CLEAN, EXIT_FINDINGS, EXIT_USAGE, UsageError, write_output
from geomopt.compile.compiler import model_params, plan_from_infos
from geomopt.compile.explain import explain, recipe, role_summary, starter
from geomopt.compile.fragments import plain
from geomopt.compile.lock import model_label
from geomopt.compile.params import params_from_checkpoint
from geomopt.compile.roles.types import TRACE_FIX
from geomopt.compile.roles.assign import ensure_roles, role_docs
from geomopt.lint.context import RULES, rule_doc
from geomopt.lint.reporters import REPORTERS, report
from geomopt.lint.roles import untraced, untraced_text
from geomopt.lint.runner import lint_spec, selected_codes
from geomopt.spec.comments import collect
from geomopt.spec.diagnostics import LANGUAGE_CODES, Diagnostic, SpecError
from geomopt.spec.extends import find_spec, layer_of
from geomopt.spec.printers import dump_spec
from geomopt.spec.schema import schema_text
from geomopt.spec.source import MAX_BYTES, NotRegularFile
from geomopt.spec.validate import format_of, gc_paused, load_spec, parse_spec, read_spec_text, source_of

UNREADABLE = "GO010"


# ---------------------------------------------------------------- exit status


def _status(diags: list[Diagnostic], strict: bool) -> int:
    if any(d.code == UNREADABLE for d in diags):
        return EXIT_USAGE
    bad = {"error", "warning"} if strict else {"error"}
    return EXIT_FINDINGS if any(d.severity in bad for d in diags) else EXIT_CLEAN


# ---------------------------------------------------------------- model loading


def _params(args):
    """ParamInfos from --model / --checkpoint, or None (lint the spec alone)."""
    if getattr(args, "model", None):
        model, inputs = load_model(args.model)
        args.model_label = model_label(model)  # a routing lock's header (plan --lock / --check)
        return model_params(model, example_inputs=inputs)[0], False
    if getattr(args, "checkpoint", None):
        try:
            return params_from_checkpoint(args.checkpoint), True
        except OSError as exc:
            hint = "; give a .pt, .pth, .bin or .safetensors file" if isinstance(exc, NotRegularFile) else ""
            raise UsageError(f"cannot read checkpoint {args.checkpoint}: {exc.strerror or exc}{hint}") from None
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    return None, False


def _required_params(args, command: str):
    """:func:`_params` for a command that needs a model or a checkpoint."""
    params, from_ckpt = _params(args)
    if params is None:
        raise UsageError(f"{command} needs --model NAME|pkg.module:factory or --checkpoint FILE")
    return params, from_ckpt


# ---------------------------------------------------------------- commands


SPEC_SUFFIXES = (".yaml", ".yml", ".geom")
SPEC_HELP = "a spec file (.yaml, .yml, .geom) or a shipped spec's name (muon, scion, …)"


def _is(path, test: str) -> bool:
    """``Path(path).exists()`` or ``.is_dir()`` (``test``), False for a name the system cannot look
    up (too long): the read or write that follows refuses it, with its reason."""
    try:
        return getattr(Path(path), test)()
    except OSError:
        return False


def _spec_files(paths) -> list[str]:
    """Files as given; a directory stands for the spec files below it (as linters do)."""
    out = []
    for path in paths:
        p = Path(path)
        if _is(p, "is_dir"):
            out += sorted(str(f) for f in p.rglob("*") if f.suffix in SPEC_SUFFIXES and f.is_file())
        else:
            out.append(path)
    return out


def _lint_file(path: str, params, from_ckpt: bool, select=None, ignore=None) -> list[Diagnostic]:
    """The findings of one spec file (its suppression comments applied); its spec is freed on return."""
    try:
        spec = load_spec(path)
    except SpecError as exc:
        return exc.diagnostics
    return lint_spec(spec, params, from_checkpoint=from_ckpt, select=select, ignore=ignore)


def cmd_lint(args) -> int:
    try:
        selected_codes(args.select, args.ignore)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    params, from_ckpt = _params(args)
    diags: list[Diagnostic] = []
    files = _spec_files(args.specs)
    if not files:
        raise UsageError(f"no spec files (.yaml, .yml, .geom) found in {', '.join(args.specs)}")
    # A large spec is a few hundred thousand small objects, all freed by reference counting: the
    # cyclic collector's passes over them would cost more than the lint itself.
    with gc_paused():
        for path in files:
            diags += _lint_file(path, params, from_ckpt, args.select, args.ignore)
    report(diags, args.format)
    if args.format == "text" and sys.stderr.isatty():
        n = {s: sum(d.severity == s for d in diags) for s in ("error", "warning", "note")}
        print(f"{len(files)} spec(s): {n['error']} error(s), {n['warning']} warning(s), {n['note']} note(s)",
              file=sys.stderr)
    if args.require_trace and any(d.code == "GO124" for d in diags):
        return EXIT_FINDINGS
    return _status(diags, args.strict)


def cmd_plan(args) -> int:
    if (args.lock or args.check) and args.format != "text":
        raise UsageError("--lock and --check write and compare a lock file; --format applies to the plan's table")
    params, from_ckpt = _required_params(args, "plan")
    try:
        spec = load_spec(args.spec)
        plan = plan_from_infos(spec, params)
    except SpecError as exc:
        report(exc.diagnostics, args.format)
        return _status(exc.diagnostics, False)
    if args.lock or args.check:
        from geomopt.cli.lock import lock_or_check  # loads the optimizer (torch): off the lint path

        return lock_or_check(args, spec, plan)
    if args.program:
        if from_ckpt:
            raise UsageError("--program needs --model: a step program depends on the tensors' devices and dtypes, "
                             "which a checkpoint's shapes do not give")
        print(step_programs(args.model, spec))
        return EXIT_CLEAN
    if args.format == "json":
        rows = [{**{f.name: plain(getattr(p, f.name)) for f in dataclasses.fields(p)}, "bucket": p.bucket}
                for p in plan.params]
        json.dump(rows, sys.stdout, indent=2, default=str)
        print()
    else:
        # notes are for lint, except that a checkpoint cannot decide module predicates (GO112) and
        # roles decided without a trace (GO124) or guessed from names (GO118) route this plan
        findings = [d for d in lint_spec(spec, params, from_checkpoint=from_ckpt)
                    if d.severity != "note" or d.code in ("GO112", "GO118", "GO124")]
        report(findings, "text", sys.stderr)
        print(plan.table())
    return EXIT_CLEAN


def step_programs(model_ref: str, spec) -> str:
    """What ``geomopt plan … --program`` prints: the optimizer built on the model, described
    (:meth:`geomopt.GeomOptimizer.describe`); its construction warnings are lint's findings,
    which ``geomopt lint`` reports."""
    import warnings

    from geomopt.optim.engine.optimizer import GeomOptimizer  # torch: off the lint path

    model, inputs = load_model(model_ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return GeomOptimizer(model, spec, example_inputs=inputs).describe()


def cmd_explain(args) -> int:
    params, _ = _required_params(args, "explain")
    spec = load_spec(args.spec)
    try:
        plan = plan_from_infos(spec, params).params
    except SpecError as exc:  # still explain the routing; the plan's findings go to stderr
        report(exc.diagnostics, "text", sys.stderr)
        plan = []

    ensure_roles(params, spec.roles)
    try:
        sys.stdout.write(explain(spec, params, plan, args.param))
    except KeyError as exc:
        raise UsageError(exc.args[0]) from None
    return EXIT_CLEAN


def cmd_init(args) -> int:
    params, _ = _params(args)  # --model is required by the parser
    try:
        text = recipe(args.recipe)
    except KeyError as exc:
        raise UsageError(exc.args[0]) from None
    spec = starter(parse_spec(text, "yaml", file=f"{args.recipe}.yaml"), params, args.model)
    guessed = untraced(params)
    roles = role_summary(params) + (f" ({untraced_text(guessed)}; {TRACE_FIX})" if guessed else "")
    head = (f"# Starter spec: the {args.recipe} recipe for {args.model}, rules by role.\n"
            f"# Roles in this model: {roles}.\n"
            f"# `geomopt explain THIS_FILE PARAM --model {args.model}` shows why a tensor gets its update.\n")
    out = head + dump_spec(spec, "yaml")
    if args.output:
        if not args.force and _is(args.output, "exists"):
            raise UsageError(f"{args.output} exists; pass --force to overwrite it")
        write_output(args.output, out)
        print(f"wrote {args.output}: {len(spec.rules)} rules (roles: {roles})", file=sys.stderr)
    else:
        sys.stdout.write(out)
    return EXIT_CLEAN


def cmd_fmt(args) -> int:
    """Canonical form, comments kept: each stays on the element it was written at (see
    :mod:`geomopt.spec.comments`), across formats too. A spec that extends another prints as
    written (``extends`` kept); ``--resolved`` prints the merged spec (without comments)."""
    if args.resolved and args.check:
        raise UsageError("--check compares a file with its canonical form; "
                         "--resolved prints another spec (the merged one)")
    try:
        path = find_spec(args.spec)
        source_format = format_of(path)
        spec = load_spec(path)
    except SpecError as exc:
        report(exc.diagnostics, "text")
        return _status(exc.diagnostics, False)
    comments = None
    current = read_spec_text(path)  # as load_spec read it (a regular file, within the size limit, UTF-8)
    if not args.resolved:
        source = source_of(spec)
        assert source is not None  # load_spec parsed the file, so the spec has its positions
        layer = layer_of(source)
        comments = collect(current.removeprefix("\ufeff"), layer.source if layer else source)
    target = args.to or source_format
    try:
        text = dump_spec(spec, target, comments, resolved=args.resolved)
    except ValueError as exc:  # a YAML null in an extending spec, which the DSL cannot spell
        raise UsageError(f"{args.spec}: {exc}") from None
    size = len(text.encode("utf-8"))
    if size > MAX_BYTES:  # a DSL string's raw control characters print as \u0001 escapes; --resolved merges
        raise UsageError(f"{args.spec}: the formatted spec would be {size} bytes, over the {MAX_BYTES} that lint "
                         f"and load read; nothing written: keep this format, or split the spec (a base with "
                         f"'extends')")
    if args.check:
        if target != source_format or current != text:
            print(f"{args.spec}: would reformat" + (f" (to {target})" if target != source_format else ""),
                  file=sys.stderr)
            return EXIT_FINDINGS
        return EXIT_CLEAN
    if args.output:
        write_output(args.output, text)
    else:
        sys.stdout.write(text)
    return EXIT_CLEAN


def cmd_schema(args) -> int:
    text = schema_text()
    if args.output:
        write_output(args.output, text)
    else:
        sys.stdout.write(text)
    return EXIT_CLEAN


def cmd_rule(args) -> int:
    if args.code in ("roles", "views"):
        if args.code == "roles":
            sys.stdout.write(role_docs())
        else:
            from geomopt.geometry import view  # geomopt.geometry loads torch: off the lint path

            sys.stdout.write(view.__doc__.strip() + "\n")
        return EXIT_CLEAN
    if not args.code:
        for code, (name, doc) in LANGUAGE_CODES.items():
            print(f"{code}  {name:<26} error    {doc}")
        for code, r in sorted(RULES.items()):
            print(f"{code}  {r.name:<26} {r.severity:<8} {_summary(r.doc)}")
        return EXIT_CLEAN
    text = rule_doc(args.code)
    if text is None:
        raise UsageError(f"unknown rule {args.code!r}; `geomopt rule` lists them")
    sys.stdout.write(text)
    return EXIT_CLEAN


def _summary(doc: str) -> str:
    """The first sentence of a docstring's first paragraph, on one line."""
    para = " ".join(doc.split("\n\n", 1)[0].split())
    m = re.search(r"(?<!e\.g)(?<!i\.e)\. ", para)
    return para if m is None else para[: m.start() + 1]


# ---------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="geomopt",
                                description="Declarative geometries and constraints for PyTorch optimizers.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def target(sp):
        g = sp.add_mutually_exclusive_group()
        g.add_argument("--model", help="built-in model name (gpt, gpt2-small, mlp, cnn) or pkg.module:factory")
        g.add_argument("--checkpoint", help="a .pt/.pth/.bin or .safetensors file (names and shapes only)")

    sp = sub.add_parser("lint", help="check specs, alone or against a model or checkpoint")
    sp.add_argument("specs", nargs="+", metavar="SPEC",
                    help="spec files, directories holding them, or shipped specs by name")
    target(sp)
    sp.add_argument("--format", choices=tuple(REPORTERS), default="text")
    sp.add_argument("--strict", action="store_true", help="warnings fail too (exit 1)")
    sp.add_argument("--require-trace", action="store_true", help="roles decided without a trace of the "
                    "model's forward (GO124) fail (exit 1)")
    sp.add_argument("--select", action="append", metavar="CODES", help="only these rules: comma-separated codes, "
                    "prefixes (GO1: every GO1xx) or rule names (as ruff's --select)")
    sp.add_argument("--ignore", action="append", metavar="CODES", help="not these rules (the more specific of "
                    "--select and --ignore wins)")
    sp.set_defaults(fn=cmd_lint)

    sp = sub.add_parser("plan", help="show the per-tensor plan of a spec against a model")
    sp.add_argument("spec", metavar="SPEC", help=SPEC_HELP)
    target(sp)
    sp.add_argument("--format", choices=("text", "json"), default="text")
    g = sp.add_mutually_exclusive_group()
    g.add_argument("--program", action="store_true", help="print each bucket's step program: its stages, the "
                   "variant the optimizer chose and why (builds the optimizer on the model)")
    g.add_argument("--lock", metavar="FILE", help="write the routing (tensor → role, rule, view) to FILE for CI")
    g.add_argument("--check", metavar="FILE", help="compare the routing with the lock FILE: exit 1 with the diff "
                   "when it changed")
    sp.set_defaults(fn=cmd_plan)

    sp = sub.add_parser("explain", help="why one tensor gets its update: role, rules, view, ops, lr, radius")
    sp.add_argument("spec", metavar="SPEC", help=SPEC_HELP)
    sp.add_argument("param", metavar="PARAM", help="the parameter's dotted name (any name of a tied tensor)")
    target(sp)
    sp.set_defaults(fn=cmd_explain)

    sp = sub.add_parser("init", help="write a starter spec for a model from its roles")
    sp.add_argument("--model", required=True, help="built-in model name or pkg.module:factory")
    sp.add_argument("--recipe", default="muon", help="muon (default), scion, uscion, adamw-hybrid, hyperball, "
                    "prox-muon-frobenius, spectral-clip, stiefel")
    sp.add_argument("-o", "--output", help="write here instead of stdout")
    sp.add_argument("--force", action="store_true", help="overwrite --output if it exists")
    sp.set_defaults(fn=cmd_init)

    sp = sub.add_parser("fmt", help="print a spec in canonical YAML or DSL form (comments kept)")
    sp.add_argument("spec", metavar="SPEC", help=SPEC_HELP)
    sp.add_argument("--to", choices=("yaml", "dsl"), help="target format (default: the file's own)")
    sp.add_argument("--check", action="store_true", help="exit 1 if the file is not already formatted")
    sp.add_argument("--resolved", action="store_true", help="a spec that extends another: print the merged spec, "
                    "without extends (default: as written)")
    sp.add_argument("-o", "--output", help="write here instead of stdout")
    sp.set_defaults(fn=cmd_fmt)

    sp = sub.add_parser("schema", help="print the JSON Schema of the spec language")
    sp.add_argument("-o", "--output")
    sp.set_defaults(fn=cmd_schema)

    sp = sub.add_parser("rule", help="explain a diagnostic code (no code: list them; 'roles', 'views': how they work)")
    sp.add_argument("code", nargs="?")
    sp.set_defaults(fn=cmd_rule)

    for _name, module in (("demo", "geomopt.cli.demo"), ("bench", "geomopt.cli.bench")):
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            continue
        mod.add_parser(sub)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except UsageError as exc:
        print(f"geomopt {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except SpecError as exc:
        report(exc.diagnostics, "text", sys.stderr)
        return _status(exc.diagnostics, False)
    except BrokenPipeError:
        return EXIT_CLEAN
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
