"""Parameter names through wrappers: a spec, a plan and a checkpoint name the model's own tensors.

Wrapping a model renames its parameters without changing them: ``torch.compile(model)`` puts
every name under ``_orig_mod.``, DDP and DataParallel under ``module.``, activation checkpointing
(``checkpoint_wrapper``) puts ``_checkpoint_wrapped_module.`` inside each wrapped block, FSDP1
``_fsdp_wrapped_module.`` (and its older flattening wrapper ``_fpw_module.``). Rules match names,
and optimizer state migrates by name, so without this every name rule would miss on a compiled
model and a compiled run's state would not find its tensors in an uncompiled one. Wherever geomopt
reads names (a model, an iterable of (name, tensor), a state dict, a checkpoint file) it reads
them through :func:`strip_names`; from a model it also looks through the wrappers
(:func:`unwrap`, :func:`named_modules`), so module predicates and roles see the wrapped module's
own classes (``Linear``, not ``CheckpointWrapper``) and methods (``get_input_embeddings``).
"""

from __future__ import annotations

from collections.abc import Iterable

#: segments that only wrappers use: removed wherever they appear in a name
WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_fpw_module"})
#: wrapper class name → the attribute holding the wrapped module (classes matched by name, so
#: torch.distributed is not imported to recognize them)
WRAPPERS = {
    "OptimizedModule": "_orig_mod",  # torch.compile
    "DistributedDataParallel": "module",
    "DataParallel": "module",
    "FullyShardedDataParallel": "_fsdp_wrapped_module",  # FSDP1
    "FlattenParamsWrapper": "_fpw_module",
    "CheckpointWrapper": "_checkpoint_wrapped_module",
    "OffloadWrapper": "_checkpoint_wrapped_module",
}


def unwrap(model):
    """The module that wrappers around ``model`` (compile, DDP, DataParallel, FSDP1, activation
    checkpointing, in any nesting) hold; ``model`` itself when it is not wrapped."""
    while True:
        attr = next((WRAPPERS[c.__name__] for c in type(model).__mro__ if c.__name__ in WRAPPERS), None)
        inner = getattr(model, attr, None) if attr is not None else None
        if inner is None or inner is model:
            return model
        model = inner


def strip(name: str) -> str:
    """``name`` without wrapper segments: ``layers.0._checkpoint_wrapped_module.weight`` →
    ``layers.0.weight``."""
    if "_" not in name:
        return name
    parts = name.split(".")
    kept = [s for s in parts if s not in WRAPPER_SEGMENTS]
    return name if len(kept) == len(parts) else ".".join(kept)


def strip_names(names: Iterable[str]) -> list[str]:
    """Names read without a model (an iterable of (name, tensor), a state dict, a checkpoint, an
    optimizer's ``param_names``): wrapper segments removed, and a leading ``module.`` when every
    name has one (DDP's and DataParallel's state dicts; a model of its own with one child called
    ``module`` looks the same and loses it too, harmlessly: spec, plan and state agree)."""
    out = [strip(n) for n in names]
    if out and all(n.startswith("module.") for n in out):
        out = [n[len("module."):] for n in out]
    return out


def named_modules(model) -> dict[str, object]:
    """``dict(model.named_modules(remove_duplicate=False))`` of the unwrapped model under stripped
    names: a wrapper inside (a checkpointed block) and the module it holds share a name, and the
    held module (listed after its wrapper) keeps it, so a parameter's owner is the real layer."""
    return {strip(n): m for n, m in unwrap(model).named_modules(remove_duplicate=False)}
