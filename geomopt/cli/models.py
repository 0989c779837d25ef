"""``--model``: the model a command lints, plans or explains against, from a built-in name or a
user's ``pkg.module:factory`` (imported from the current directory), with its example inputs
where the factory returns them; every failure of the user's code is a one-line usage error."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from geomopt.cli.status import UsageError


def load_model(ref: str):
    """(model, example inputs or None) from ``NAME`` (a built-in model) or ``pkg.module:factory``
    (a callable returning an nn.Module, or ``(model, inputs)``: the inputs of one forward that roles
    are traced on)."""
    from geomopt.models import MODELS  # the models need torch: off the lint path

    if ":" not in ref:
        if ref in MODELS:
            return MODELS[ref](), None
        raise UsageError(f"unknown model {ref!r}: use a built-in name ({', '.join(MODELS)}) or pkg.module:factory")
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise UsageError(f"--model {ref!r}: expected a built-in name or pkg.module:factory")
    sys.path.insert(0, str(Path.cwd()))
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"cannot import {module_name!r} for --model {ref}: {exc}") from None
    except Exception as exc:  # the user's module failed while importing: say so, no traceback
        raise UsageError(f"--model {ref}: importing {module_name!r} raised {type(exc).__name__}: {exc}") from None
    finally:
        sys.path.pop(0)
    factory: object = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise UsageError(f"{module_name!r} has no attribute {attr!r} (--model {ref})")
    try:
        model = factory() if callable(factory) else factory
    except Exception as exc:  # the user's factory failed: say so, no traceback
        raise UsageError(f"--model {ref}: the factory raised {type(exc).__name__}: {exc}") from None
    import torch  # torch: off the lint path (a spec alone never loads it)

    from geomopt.compile.trace.inputs import as_inputs  # the tracer needs torch: off the lint path

    model, inputs = model if isinstance(model, tuple) and len(model) == 2 else (model, None)
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"--model {ref} returned {type(model).__name__}, not a torch.nn.Module or a "
                         f"(module, example inputs) pair")
    try:
        return model, None if inputs is None else as_inputs(inputs, f"--model {ref}'s inputs")
    except TypeError as exc:
        raise UsageError(str(exc)) from None
