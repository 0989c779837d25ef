"""Collect :class:`ParamInfo` from a model, an iterable of (name, tensor), or a checkpoint file.

A checkpoint is read for names and shapes only (no model code): ``.safetensors`` through its
JSON header, ``.pt``/``.pth``/``.bin`` through ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
import pickle
import zipfile

from geomopt.compile.match import ParamInfo
from geomopt.compile.wrappers import named_modules, strip, strip_names, unwrap
from geomopt.spec.source import check_regular, open_regular


def _module_classes(module) -> tuple[str, ...]:
    return tuple(c.__name__ for c in type(module).__mro__ if c.__name__ not in ("Module", "object"))


def params_from_model(model, modules: dict | None = None) -> tuple[list[ParamInfo], dict[str, object]]:
    """(infos, tensors by name) from an ``nn.Module`` or an iterable of (name, tensor).

    Tied tensors (one tensor under several names) appear once, under their first name, with the
    other names in ``aliases`` and the module classes of every name in ``modules`` (a rule that
    matches any of its names matches it). Names are the wrapped model's own: without the segments
    torch.compile, DDP, FSDP1 and activation checkpointing add (:mod:`geomopt.compile.wrappers`).
    ``modules``: :func:`~geomopt.compile.wrappers.named_modules` of the model when the caller has it
    already. Frozen means an ``nn.Parameter`` with
    ``requires_grad=False``; plain tensors in an iterable (e.g. a state dict's values, which never
    require grad) are not frozen, as in a checkpoint.
    """
    import torch  # torch: off the lint path (a spec alone never loads it)

    if isinstance(model, torch.nn.Module):
        named = [(strip(n), t) for n, t in unwrap(model).named_parameters(remove_duplicate=False)]
        owner = modules if modules is not None else named_modules(model)
    else:
        try:
            pairs = [(str(n), t) for n, t in model]
            named = list(zip(strip_names(n for n, _ in pairs), (t for _, t in pairs)))
        except (TypeError, ValueError):
            raise TypeError(f"model must be an nn.Module or an iterable of (name, tensor) pairs, not "
                            f"{type(model).__name__}: rules match parameter names, so pass the model or "
                            f"model.named_parameters() rather than model.parameters()") from None
        owner = None
    parameter = torch.nn.Parameter
    first: dict[int, int] = {}
    rows: list[list] = []  # [name, tensor, aliases, modules]
    classes: dict[type, tuple[str, ...]] = {}
    seen: dict[str, int] = {}
    for name, tensor in named:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"parameter {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        if name in seen:
            if seen[name] == id(tensor):
                continue  # the same pair listed twice
            raise ValueError(f"parameter name {name!r} appears twice with different tensors")
        seen[name] = id(tensor)
        mod_classes: tuple[str, ...] | None = None
        if owner is not None:
            mod = owner.get(name.rpartition(".")[0])
            if mod is None:
                mod_classes = ()
            else:
                cls = type(mod)
                mod_classes = classes.get(cls)
                if mod_classes is None:
                    mod_classes = classes[cls] = _module_classes(mod)
        key = id(tensor)
        if key in first:
            row = rows[first[key]]
            row[2].append(name)
            if mod_classes is not None:
                row[3] = row[3] + tuple(m for m in mod_classes if m not in row[3])
            continue
        first[key] = len(rows)
        rows.append([name, tensor, [], mod_classes])
    dtypes: dict = {}
    devices: dict = {}
    infos, tensors = [], {}
    for name, tensor, aliases, mod_classes in rows:
        dtype = dtypes.get(tensor.dtype) or dtypes.setdefault(tensor.dtype, str(tensor.dtype).removeprefix("torch."))
        device = devices.get(tensor.device) or devices.setdefault(tensor.device, str(tensor.device))
        frozen = isinstance(tensor, parameter) and not tensor.requires_grad
        infos.append(ParamInfo(name, tuple(tensor.shape), dtype, not frozen, mod_classes, tuple(aliases), device))
        tensors[name] = tensor
    return infos, tensors


def params_from_checkpoint(path: str | Path) -> list[ParamInfo]:
    """Names (wrapper segments stripped: :mod:`geomopt.compile.wrappers`), shapes and dtypes of the
    floating-point tensors in a checkpoint (raises OSError / ValueError with a readable message on
    a bad file)."""
    path = Path(path)
    check_regular(path)  # not a FIFO (reading one would wait for a writer), a device or a directory
    if path.suffix == ".safetensors":
        entries = _safetensors_header(path)
    else:
        entries = _torch_checkpoint(path)
    entries = [e for e in entries if e[2].startswith(("float", "bfloat", "F", "BF"))]
    names = strip_names(n for n, _, _ in entries)  # a compiled or DDP model's file: the same names as the model's
    return [ParamInfo(name=name, shape=s, dtype=d, modules=None) for name, (_, s, d) in zip(names, entries)]


#: bytes per entry of each safetensors dtype (the format's list); another dtype's size is not checked
SAFETENSORS_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
                     "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "C64": 8}


def _safetensors_header(path: Path) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of each tensor a safetensors header lists, refusing a header whose
    tensors the file cannot hold: each tensor's ``data_offsets`` [begin, end] lie within the bytes
    after the header, and where its dtype's size is known, end − begin = size·∏shape (a header
    claiming a 10⁶ × 10⁶ matrix in a file of a few bytes plans, and reports, a model that is not
    there)."""
    with open_regular(path) as f:
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
        except RecursionError:  # json.loads recurses per level: `{"a": [[[[…` 100,000 deep
            raise ValueError(f"{path}: not a safetensors file (header nested too deeply)") from None
        held = max(f.seek(0, 2) - 8 - n, 0)  # the bytes after the header
    if not isinstance(header, dict):
        raise ValueError(f"{path}: not a safetensors file (header is not a JSON object)")
    # keyed by whatever the header holds: an unknown dtype (or none) is shown as written
    dtypes: dict[object, str] = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}
    out = []
    for name, meta in header.items():
        if name == "__metadata__" or not isinstance(meta, dict):
            continue
        shape = meta.get("shape", [])
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise ValueError(f"{path}: not a safetensors file (tensor {name!r} has shape {shape!r})")
        _check_extent(path, name, meta, shape, held)
        out.append((name, tuple(shape), dtypes.get(meta.get("dtype"), str(meta.get("dtype")))))
    return out


def _check_extent(path: Path, name: str, meta: dict, shape: list, held: int) -> None:
    """A tensor's ``data_offsets`` within the ``held`` data bytes and, for a dtype of known size,
    exactly its shape's bytes."""
    offsets = meta.get("data_offsets")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) and not isinstance(o, bool)
                                                                       for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= held):
        raise ValueError(f"{path}: not a safetensors file (tensor {name!r} has data_offsets {offsets!r}; the file "
                         f"holds {held} data bytes)")
    size = SAFETENSORS_SIZES.get(meta.get("dtype"))  # type: ignore[arg-type]
    if size is not None and math.prod(shape) * size != offsets[1] - offsets[0]:
        raise ValueError(f"{path}: not a safetensors file (tensor {name!r} of shape {shape} and dtype "
                         f"{meta.get('dtype')} needs {math.prod(shape) * size} bytes, its data_offsets give "
                         f"{offsets[1] - offsets[0]})")


def _torch_checkpoint(path: Path) -> list[tuple[str, tuple[int, ...], str]]:
    import torch  # torch: off the lint path (a spec alone never loads it)

    try:
        # mmap (no tensor data read) works for the zip format torch.save writes since 1.6 only
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except OSError:
        raise
    except Exception as exc:  # noqa: BLE001 (the unpickler raises anything on a corrupt file)
        text = str(exc).strip()
        if isinstance(exc, pickle.UnpicklingError) and text.startswith("Weights only load failed"):
            why = "weights-only unpickling failed: not a file of tensors and plain containers"
        else:
            why = (text.splitlines()[0][:200] if text and not isinstance(exc, (KeyError, IndexError))
                   else type(exc).__name__)
        raise ValueError(f"{path}: not a readable torch checkpoint ({why})") from None
    for key in ("state_dict", "model", "model_state_dict"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a state dict (name → tensor), found {type(obj).__name__}")
    return [(str(n), tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in obj.items()
            if isinstance(t, torch.Tensor)]

