"""Small reference models for the demo, tests and benchmarks (random init, built from code).

``get_model(name)`` builds one by name: ``gpt`` (nanoGPT-style, GPT-2 parameter names),
``gpt2-small``/``-medium``/``-large`` (GPT-2 shapes), ``gpt-bench`` (``-x2``, ``-x4``: deeper;
``-w2``, ``-w4``: wider) for CPU benchmarks, ``mlp``, ``cnn``.
"""

from __future__ import annotations

from typing import Callable

from geomopt.models.cnn import SmallCNN
from geomopt.models.gpt import GPT, GPTConfig
from geomopt.models.mlp import MLP

MODELS: dict[str, Callable] = {
    "gpt": lambda: GPT(GPTConfig()),
    "gpt2-small": lambda: GPT(GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)),
    "gpt2-medium": lambda: GPT(GPTConfig(vocab_size=50304, block_size=1024, n_layer=24, n_head=16, n_embd=1024)),
    "gpt2-large": lambda: GPT(GPTConfig(vocab_size=50304, block_size=1024, n_layer=36, n_head=20, n_embd=1280)),
    # CPU-sized benchmark models: depth ×1, ×2, ×4 at width 256
    "gpt-bench": lambda: GPT(GPTConfig(vocab_size=256, block_size=256, n_layer=2, n_head=4, n_embd=256)),
    "gpt-bench-x2": lambda: GPT(GPTConfig(vocab_size=256, block_size=256, n_layer=4, n_head=4, n_embd=256)),
    "gpt-bench-x4": lambda: GPT(GPTConfig(vocab_size=256, block_size=256, n_layer=8, n_head=4, n_embd=256)),
    # and width ×2, ×4 at depth 2
    "gpt-bench-w2": lambda: GPT(GPTConfig(vocab_size=256, block_size=256, n_layer=2, n_head=4, n_embd=512)),
    "gpt-bench-w4": lambda: GPT(GPTConfig(vocab_size=256, block_size=256, n_layer=2, n_head=4, n_embd=1024)),
    "mlp": lambda: MLP(),
    "cnn": lambda: SmallCNN(),
}


def get_model(name: str):
    try:
        return MODELS[name]()
    except KeyError:
        raise KeyError(f"unknown model {name!r}; built-in models: {', '.join(MODELS)}") from None


__all__ = ["GPT", "GPTConfig", "MLP", "MODELS", "SmallCNN", "get_model"]
