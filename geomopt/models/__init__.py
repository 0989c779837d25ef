"""Small reference models for the demo, tests and benchmarks (random init, built from code).

``get_model(name)`` builds one by name: ``gpt`` (nanoGPT-style, GPT-2 parameter names),
``gpt2-small`` (GPT-2 124M shapes), ``mlp``, ``cnn``.
"""

from __future__ import annotations

from typing import Callable

from geomopt.models.cnn import SmallCNN
from geomopt.models.gpt import GPT, GPTConfig
from geomopt.models.mlp import MLP

MODELS: dict[str, Callable] = {
    "gpt": lambda: GPT(GPTConfig()),
    "gpt2-small": lambda: GPT(GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)),
    "mlp": lambda: MLP(),
    "cnn": lambda: SmallCNN(),
}


def get_model(name: str):
    try:
        return MODELS[name]()
    except KeyError:
        raise KeyError(f"unknown model {name!r}; built-in models: {', '.join(MODELS)}") from None


__all__ = ["GPT", "GPTConfig", "MLP", "MODELS", "SmallCNN", "get_model"]
