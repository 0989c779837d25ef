"""Inputs for the traced forward (:mod:`geomopt.compile.trace`).

From the caller (``example_inputs=`` in Python; a ``--model`` factory returning ``(model, inputs)``
in the CLI), from a model's own ``example_inputs()`` method (geomopt's built-in models have one),
or built for a Hugging Face model from its config: a few tokens (``input_ids``), a small image
(``pixel_values``), audio features (``input_features``, ``input_values``), decoder tokens for an
encoder-decoder; beside a text model's tokens, when it has a ``vision_config``, images: for a
dual tower (CLIP, SigLIP) pixels alone, for a model splicing image features into its text
(LLaVA, PaliGemma, Gemma 3) pixels and their placeholder tokens, for Qwen2-VL one image of a
single merged patch with its placeholder token. Two rows throughout (:data:`BATCH`): BatchNorm
in training refuses a batch of one on a pooled 1×1 map (a squeeze-excitation block).
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


BATCH = 2  # rows of every built input: BatchNorm in training refuses one value per channel (a pooled 1×1 map)
TOKENS = 4  # text tokens per row


def _get(config, *names, default=None, owners=("text_config", "encoder")):
    """The first of ``names`` set on ``config`` or its sub-configs ``owners`` (text, encoder)."""
    for owner in (config, *(getattr(config, o, None) for o in owners)):
        for n in names:
            v = getattr(owner, n, None) if owner is not None else None
            if v is not None:
                return v
    return default


def _hf_inputs(model, config, main: str) -> Optional[Inputs]:
    params = inspect.signature(model.forward).parameters
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    vocab = int(_get(config, "vocab_size", default=16))
    kwargs: dict[str, Any] = {}
    if main == "input_ids":
        kwargs["input_ids"] = _tokens(vocab, device)
        vision = getattr(config, "vision_config", None)
        if vision is not None and "pixel_values" in params:
            kwargs.update(_vl_image(config, vision, vocab, device) if "image_grid_thw" in params
                          else _image(config, vision, vocab, device))
        if "attention_mask" in params:
            kwargs["attention_mask"] = torch.ones_like(kwargs["input_ids"])
        if "pixel_values" in kwargs and "mm_token_type_ids" in params:  # 1 marks the image's tokens
            kwargs["mm_token_type_ids"] = (kwargs["input_ids"] == _image_token(config)).int()
    elif main == "pixel_values":
        kwargs["pixel_values"] = _pixels(config, device)
    elif main == "input_features":
        mels = int(_get(config, "num_mel_bins", "feature_size", default=80))
        frames = 2 * int(_get(config, "max_source_positions", default=TOKENS))
        kwargs["input_features"] = torch.zeros(BATCH, mels, frames, device=device)
    elif main == "input_values":
        kwargs["input_values"] = torch.zeros(BATCH, 1600, device=device)
    else:
        return None
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        dec_vocab = int(_get(config, "decoder_vocab_size", default=vocab) or vocab)
        kwargs["decoder_input_ids"] = torch.arange(TOKENS, device=device).repeat(BATCH, 1) % max(dec_vocab, 1)
    if "use_cache" in params:
        kwargs["use_cache"] = False
    return Inputs((), kwargs, f"{type(model).__name__}'s config")


def _tokens(vocab: int, device, first: Optional[list] = None) -> torch.Tensor:
    """(BATCH, …) token ids: ``first`` (placeholders), then TOKENS ordinary ones (1, 2, …: not 0,
    often padding) inside the vocabulary."""
    row = list(first or []) + [i % max(vocab - 1, 1) + (1 if vocab > 1 else 0) for i in range(TOKENS)]
    return torch.tensor([row] * BATCH, device=device)


def _pixels(config, device) -> torch.Tensor:
    """(BATCH, channels, h, w) zeros at the config's image size (64 × 64 when it names none)."""
    size = _get(config, "image_size", default=64)
    h, w = (size, size) if isinstance(size, int) else tuple(size)[-2:]
    channels = int(_get(config, "num_channels", default=3))
    return torch.zeros(BATCH, channels, int(h), int(w), device=device)


def _image_token(config) -> Optional[int]:
    return _get(config, "image_token_id", "image_token_index", owners=())


def _image(config, vision, vocab: int, device) -> dict:
    """Pixels beside the text: for a dual tower (CLIP, SigLIP: no image placeholder) one image per
    row; for a model that splices image features into the text (LLaVA, PaliGemma, Gemma 3) also
    its placeholder tokens, as many as :func:`_image_tokens` counts, before the text. Nothing when
    the placeholder lies outside the vocabulary (the text alone is traced)."""
    token = _image_token(config)
    if token is None:
        return {"pixel_values": _pixels(vision, device)}
    count = _image_tokens(config, vision)
    if token >= vocab or count is None:
        return {}
    return {"input_ids": _tokens(vocab, device, [token] * count), "pixel_values": _pixels(vision, device)}


def _image_tokens(config, vision) -> Optional[int]:
    """Placeholder tokens one image takes in the text: a count the model itself pools to
    (``mm_tokens_per_image``, Gemma 3), else one per patch of the vision tower plus its class token
    when ``vision_feature_select_strategy`` is ``full`` (LLaVA, PaliGemma), else the count the
    config gives its processor (``image_seq_length``, ``image_seq_len``, ``num_image_tokens``)."""
    pooled = _get(config, "mm_tokens_per_image", owners=())
    if pooled is not None:
        return int(pooled)
    size, patch = getattr(vision, "image_size", None), getattr(vision, "patch_size", None)
    if isinstance(size, int) and isinstance(patch, int):
        return (size // patch) ** 2 + (getattr(config, "vision_feature_select_strategy", None) == "full")
    own = _get(config, "image_seq_length", "image_seq_len", "num_image_tokens")
    return None if own is None else int(own)


def _vl_image(config, vision, vocab: int, device) -> dict:
    """One image of one merged patch per row for a Qwen2-VL-style model: flattened patches, their
    grids, and the placeholder token in the text (skipped when the placeholder lies outside the
    vocabulary)."""
    token = _image_token(config)
    if token is None or token >= vocab:
        return {}
    merge = int(getattr(vision, "spatial_merge_size", 1))
    patch = int(getattr(vision, "patch_size", 14))
    temporal = int(getattr(vision, "temporal_patch_size", 1))
    channels = int(getattr(vision, "in_chans", getattr(vision, "in_channels", 3)))
    grid = torch.tensor([[1, merge, merge]] * BATCH, device=device)
    pixels = torch.zeros(BATCH * merge * merge, channels * temporal * patch * patch, device=device)
    return {"input_ids": _tokens(vocab, device, [token]), "pixel_values": pixels, "image_grid_thw": grid}


__all__ = ["Inputs", "as_inputs", "default_inputs"]
