"""A model's module tree, read once: its modules by name, their children, and what role inference
asks of a module's class (norm, embedding, its weight and output features), cached per class."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch

#: a norm layer's class name (LayerNorm, RMSNorm, BatchNorm2d, …)
_NORM = re.compile(r"Norm(\dd)?$")


class ModuleTree:
    """The module tree of a model, read once."""

    def __init__(self, model, modules: Optional[dict] = None):
        self.model = model
        self.modules: dict[str, torch.nn.Module] = (modules if modules is not None
                                                    else dict(model.named_modules(remove_duplicate=False)))
        self.classes: dict[type, tuple[str, ...]] = {}
        self.norms: dict[type, bool] = {}
        self.embeddings: dict[type, Optional[str]] = {}
        self.experts: Optional[list] = None
        self.excluded: list[str] = []  # modules the head rule skips (claimed as norm, embedding, router, expert)
        self.children: dict[str, list[str]] = {}
        for name in self.modules:
            if name:
                self.children.setdefault(name.rpartition(".")[0], []).append(name)

    def mro(self, module) -> tuple[str, ...]:
        cls = type(module)
        names = self.classes.get(cls)
        if names is None:
            names = self.classes[cls] = tuple(c.__name__ for c in cls.__mro__)
        return names

    def is_norm(self, module) -> bool:
        cls = type(module)
        hit = self.norms.get(cls)
        if hit is None:
            hit = self.norms[cls] = any(_NORM.search(n) for n in self.mro(module))
        return hit

    def weight(self, module):
        """A leaf layer's 2-D+ ``weight`` (Linear, Conv, Conv1D, a router's own weight), else None."""
        w = getattr(module, "weight", None)
        import torch  # torch: off the lint path (a spec alone never loads it)

        return w if isinstance(w, torch.Tensor) and w.ndim >= 2 else None

    def out_features(self, module) -> Optional[int]:
        w = self.weight(module)
        if w is None:
            return None
        return w.shape[1] if "Conv1D" in self.mro(module) else w.shape[0]
