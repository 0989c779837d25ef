"""Inputs for the traced forward (:mod:`geomopt.compile.trace`).

From the caller (``example_inputs=`` in Python; a ``--model`` factory returning ``(model, inputs)``
in the CLI), from a model's own ``example_inputs()`` method (geomopt's built-in models have one),
or built for a Hugging Face model from its config: a few tokens (``input_ids``), a small image
(``pixel_values``), audio features (``input_features``, ``input_values``), decoder tokens for an
encoder-decoder, and for a vision-language model with a ``vision_config`` (Qwen2-VL) one image of
a single merged patch with its placeholder token. Batch 1 throughout.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Optional

import torch


@dataclasses.dataclass(frozen=True)
class Inputs:
    """Positional and keyword arguments of one forward, and where they came from."""

    args: tuple = ()
    kwargs: dict = dataclasses.field(default_factory=dict)
    source: str = "example_inputs"


def as_inputs(value: Any, source: str = "example_inputs") -> Inputs:
    """``value`` as :class:`Inputs`: a tensor (one positional argument), a tuple or list
    (positional arguments), a dict (keyword arguments), an ``(args tuple, kwargs dict)`` pair, an
    :class:`Inputs`, or a callable returning one of these. Raises TypeError saying what is expected."""
    if isinstance(value, Inputs):
        return value
    if callable(value) and not isinstance(value, torch.Tensor):
        return as_inputs(value(), source)
    if isinstance(value, torch.Tensor):
        return Inputs((value,), {}, source)
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"{source}: a dict of inputs must map argument names (str) to values")
        return Inputs((), dict(value), source)
    if (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], (tuple, list))
            and isinstance(value[1], dict)):
        return Inputs(tuple(value[0]), dict(value[1]), source)
    if isinstance(value, (tuple, list)):
        return Inputs(tuple(value), {}, source)
    raise TypeError(f"{source} must be a tensor, a tuple of positional arguments, a dict of keyword arguments, "
                    f"an (args, kwargs) pair or a callable returning one, not {type(value).__name__}")


def default_inputs(model: torch.nn.Module) -> Optional[Inputs]:
    """The model's own inputs: its ``example_inputs()`` method, else a Hugging Face model's from
    its config; None when neither applies. Raises what building them raised (a failing method, a
    config this builder cannot read)."""
    own = getattr(model, "example_inputs", None)
    if callable(own):
        return as_inputs(own(), f"{type(model).__name__}.example_inputs()")
    config = getattr(model, "config", None)
    main = getattr(model, "main_input_name", None)
    if config is None or not isinstance(main, str):
        return None
    return _hf_inputs(model, config, main)  # an unusual config raises: the caller says why there is no trace


def _get(config, *names, default=None):
    """The first of ``names`` set on ``config`` or its text / vision / encoder sub-configs."""
    for owner in (config, getattr(config, "text_config", None), getattr(config, "encoder", None)):
        for n in names:
            v = getattr(owner, n, None) if owner is not None else None
            if v is not None:
                return v
    return default


def _hf_inputs(model, config, main: str) -> Optional[Inputs]:
    params = inspect.signature(model.forward).parameters
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    tokens = 4
    vocab = int(_get(config, "vocab_size", default=16))
    ids = (torch.arange(tokens, device=device) % max(vocab - 1, 1) + (1 if vocab > 1 else 0)).unsqueeze(0)
    kwargs: dict[str, Any] = {}
    if main == "input_ids":
        kwargs["input_ids"] = ids
        if "attention_mask" in params:
            kwargs["attention_mask"] = torch.ones_like(ids)
        vision = getattr(config, "vision_config", None)
        if vision is not None and "pixel_values" in params and "image_grid_thw" in params:
            kwargs.update(_vl_image(config, vision, vocab, device))
            if "pixel_values" in kwargs and "mm_token_type_ids" in params:  # 1 marks the image's tokens
                kwargs["mm_token_type_ids"] = (kwargs["input_ids"] == config.image_token_id).int()
    elif main == "pixel_values":
        size = _get(config, "image_size", default=64)
        h, w = (size, size) if isinstance(size, int) else tuple(size)[-2:]
        channels = int(_get(config, "num_channels", default=3))
        kwargs["pixel_values"] = torch.zeros(1, channels, int(h), int(w), device=device)
    elif main == "input_features":
        mels = int(_get(config, "num_mel_bins", "feature_size", default=80))
        frames = 2 * int(_get(config, "max_source_positions", default=tokens))
        kwargs["input_features"] = torch.zeros(1, mels, frames, device=device)
    elif main == "input_values":
        kwargs["input_values"] = torch.zeros(1, 1600, device=device)
    else:
        return None
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        dec_vocab = int(_get(config, "decoder_vocab_size", default=vocab) or vocab)
        kwargs["decoder_input_ids"] = torch.arange(tokens, device=device).unsqueeze(0) % max(dec_vocab, 1)
    if "use_cache" in params:
        kwargs["use_cache"] = False
    return Inputs((), kwargs, f"{type(model).__name__}'s config")


def _vl_image(config, vision, vocab: int, device) -> dict:
    """One image of one merged patch for a Qwen2-VL-style model: flattened patches, their grid, and
    the placeholder token in the text (skipped when the placeholder lies outside the vocabulary)."""
    token = getattr(config, "image_token_id", None)
    if token is None or token >= vocab:
        return {}
    merge = int(getattr(vision, "spatial_merge_size", 1))
    patch = int(getattr(vision, "patch_size", 14))
    temporal = int(getattr(vision, "temporal_patch_size", 1))
    channels = int(getattr(vision, "in_chans", getattr(vision, "in_channels", 3)))
    grid = torch.tensor([[1, merge, merge]], device=device)
    pixels = torch.zeros(merge * merge, channels * temporal * patch * patch, device=device)
    ids = torch.tensor([[1, token, 2, 3]], device=device) % vocab
    ids[0, 1] = token
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels, "image_grid_thw": grid}


__all__ = ["Inputs", "as_inputs", "default_inputs"]
