"""Collect :class:`ParamInfo` from a model, an iterable of (name, tensor), or a checkpoint file.

A checkpoint is read for names and shapes only (no model code): ``.safetensors`` through its
JSON header, ``.pt``/``.pth``/``.bin`` through ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from geomopt.compile.match import ParamInfo


def _module_classes(module) -> tuple[str, ...]:
    return tuple(c.__name__ for c in type(module).__mro__ if c.__name__ not in ("Module", "object"))


def params_from_model(model) -> tuple[list[ParamInfo], dict[str, object]]:
    """(infos, tensors by name) from an ``nn.Module`` or an iterable of (name, tensor).

    Tied tensors (one tensor under several names) appear once, under their first name, with the
    other names in ``aliases``.
    """
    import torch

    if isinstance(model, torch.nn.Module):
        named = list(model.named_parameters(remove_duplicate=False))
        owner = dict(model.named_modules(remove_duplicate=False))
    else:
        named = [(str(n), t) for n, t in model]
        owner = None
    first: dict[int, int] = {}
    rows: list[dict] = []
    tensors: dict[str, object] = {}
    for name, tensor in named:
        key = id(tensor)
        if key in first:
            rows[first[key]]["aliases"].append(name)
            continue
        first[key] = len(rows)
        modules = None
        if owner is not None:
            mod = owner.get(name.rpartition(".")[0])
            modules = _module_classes(mod) if mod is not None else ()
        rows.append(dict(name=name, shape=tuple(tensor.shape), dtype=str(tensor.dtype).removeprefix("torch."),
                         requires_grad=bool(getattr(tensor, "requires_grad", True)), modules=modules, aliases=[],
                         device=str(tensor.device)))
        tensors[name] = tensor
    infos = [ParamInfo(**{**r, "aliases": tuple(r["aliases"])}) for r in rows]
    return infos, tensors


def params_from_checkpoint(path: str | Path) -> list[ParamInfo]:
    """Names, shapes and dtypes of the floating-point tensors in a checkpoint (raises OSError /
    ValueError with a readable message on a bad file)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        entries = _safetensors_header(path)
    else:
        entries = _torch_checkpoint(path)
    return [ParamInfo(name=n, shape=s, dtype=d, modules=None) for n, s, d in entries
            if d.startswith(("float", "bfloat", "F", "BF"))]


def _safetensors_header(path: Path) -> list[tuple[str, tuple[int, ...], str]]:
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 << 20:
            raise ValueError(f"{path}: not a safetensors file (header length {n})")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ValueError(f"{path}: not a safetensors file (bad header)") from None
    dtypes = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
    out = []
    for name, meta in header.items():
        if name == "__metadata__" or not isinstance(meta, dict):
            continue
        out.append((name, tuple(meta.get("shape", ())), dtypes.get(meta.get("dtype"), str(meta.get("dtype")))))
    return out


def _torch_checkpoint(path: Path) -> list[tuple[str, tuple[int, ...], str]]:
    import pickle

    import torch

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{path}: not a readable torch checkpoint ({first})") from None
    for key in ("state_dict", "model", "model_state_dict"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a state dict (name → tensor), found {type(obj).__name__}")
    return [(str(n), tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in obj.items() if isinstance(t, torch.Tensor)]

