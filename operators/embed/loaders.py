"""User image encoders from local files: the contract, and the loading path behind it.

Sits under ``modalign.operators.embed.image.ImageEncoder``: when its config names a model other
than the built-in ``efficientnet-lite0..4``, the network comes from here instead of the
packaged EfficientNet weights. No code change is needed to plug one in; a run config
entry is enough (``embed.image_encoder`` in the run config, mapped onto
``ImageEmbedConfig`` by ``modalign.operators.embed.registry``).

Contract of a user encoder:

- **Name** (``model``): letters, digits, ``_ . -``; recorded as ``NAME@HASH`` in every
  cache key, feature row and lineage row. The names ``efficientnet-lite0..4`` are the
  built-in family.
- **Weights** (``weights_path``), one of:
  - a TorchScript file (``torch.jit.save`` of a scripted or traced module), loaded with
    ``torch.jit.load(map_location="cpu")`` when ``factory`` is not set;
  - a state dict for ``factory``: ``torch.save(model.state_dict(), FILE)``, or a
    checkpoint dict holding it under ``"state_dict"`` or ``"model"`` (torchvision /
    Lightning style; a ``"module."`` prefix from DataParallel is stripped). Loaded with
    ``torch.load(weights_only=True)`` (no pickled code runs) and
    ``load_state_dict(strict=True)``.
- **Factory** (``factory``): ``"package.module:callable"`` (dots after the colon reach
  attributes, e.g. ``"mypkg.nets:Builders.small"``); called as
  ``callable(**factory_kwargs)`` it returns a ``torch.nn.Module``. The module must be
  importable in every worker (an installed package, or on ``PYTHONPATH``).
- **Input**: float32 ``(N, 3, S, S)``, RGB, ``(pixel / 255 - mean) / std`` per channel,
  ``S = image_size`` (bilinear, antialiased resize of the whole frame); ``mean`` and
  ``std`` are config fields (ImageNet's by default) and part of the cache key.
- **Output**: a tensor ``(N, C, h, w)``, a *feature map*: it is the patch grid, and the
  frame and roi vectors are pooled from it exactly as for EfficientNet; or ``(N, C)``, a
  *vector*: the frame vector is that vector, each roi vector comes from a forward pass on
  the box's crop, and the patch grid is the 1 x 1 grid holding the vector. A tuple or list
  output uses its first element. Return activations as they are: pooled vectors are
  L2-normalised by the caller.
- **Runtime**: ``eval()`` mode, ``torch.inference_mode``, gradients off; fp32 on the CPU,
  bf16 autocast on CUDA; the output is read back as float32.
- **Identity**: ``model_id = NAME@<first 12 hex of sha256>`` of the weights file
  (TorchScript), or of the weights file's sha256 plus the factory path and its kwargs
  (the same state dict shaped by another factory is another model).

Errors are ``ConfigError`` (what is wrong with which file or name, and what to do), or
``DependencyMissingError`` when torch itself is missing.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from modalign.operators.dependencies import require
from modalign.schemas.errors import ConfigError

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
FACTORY_PATTERN = r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$"
_FACTORY_RE = re.compile(FACTORY_PATTERN)


def resolve_factory(spec: str) -> Callable[..., Any]:
    """The callable named by ``"package.module:attr[.attr...]"``."""
    if not _FACTORY_RE.match(spec or ""):
        raise ConfigError(f"image encoder factory must look like 'package.module:callable', got {spec!r}")
    module_name, attr_path = spec.split(":", 1)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(
            f"image encoder factory module {module_name!r} cannot be imported ({e}); install it or put it on "
            "PYTHONPATH on every worker"
        ) from e
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"image encoder factory {spec!r}: {module_name} has no attribute {attr_path!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConfigError(f"image encoder factory {spec!r} is not callable")
    return obj


def extract_state_dict(obj: Any, source: Path) -> dict[str, Any]:
    """The tensor mapping of a state dict or of a checkpoint dict holding one."""
    torch = require("torch")
    if isinstance(obj, Mapping):
        for key in ("state_dict", "model"):
            inner = obj.get(key)
            if isinstance(inner, Mapping) and inner and all(isinstance(v, torch.Tensor) for v in inner.values()):
                obj = inner
                break
    if not isinstance(obj, Mapping) or not obj or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ConfigError(
            f"weights file {source} holds no state dict (expected torch.save(model.state_dict()) or a checkpoint "
            "with a 'state_dict' or 'model' entry); a TorchScript file needs no factory"
        )
    state = dict(obj)
    if all(k.startswith("module.") for k in state):
        state = {k[len("module."):]: v for k, v in state.items()}
    return state


def load_user_module(weights: Path, factory: str | None, factory_kwargs: Mapping[str, Any] | None = None) -> Any:
    """The user's network on the CPU, in eval mode, gradients off (see the module contract)."""
    torch = require("torch")
    weights = Path(weights)
    if not weights.is_file():
        raise ConfigError(f"image encoder weights file {weights} does not exist")
    if factory is None:
        try:
            model = torch.jit.load(str(weights), map_location="cpu")
        except RuntimeError as e:
            raise ConfigError(
                f"{weights} is not a TorchScript file; save one with torch.jit.save, or set a factory "
                "('package.module:callable') to load it as a state dict"
            ) from e
    else:
        build = resolve_factory(factory)
        model = build(**dict(factory_kwargs or {}))
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(
                f"image encoder factory {factory!r} returned {type(model).__name__}, not a torch.nn.Module")
        try:
            raw = torch.load(str(weights), map_location="cpu", weights_only=True)
        except Exception as e:  # pickle errors, truncated files: all mean "not a loadable state dict"
            raise ConfigError(f"weights file {weights} cannot be read as a state dict ({type(e).__name__})") from e
        try:
            model.load_state_dict(extract_state_dict(raw, weights), strict=True)
        except RuntimeError as e:
            raise ConfigError(f"weights file {weights} does not fit the network built by {factory!r}: {e}") from e
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def user_model_digest(weights_sha256: str, factory: str | None, factory_kwargs: Mapping[str, Any] | None) -> str:
    """sha256 hex identifying a user encoder: the weights alone (TorchScript), or with the factory."""
    if factory is None:
        return weights_sha256
    record = {"weights": weights_sha256, "factory": factory, "kwargs": dict(factory_kwargs or {})}
    text = json.dumps(record, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def as_feature_grid(output: Any) -> Any:
    """A network output as a float32 (N, h, w, C) tensor: (N, C, h, w) maps, (N, C) vectors as 1 x 1."""
    torch = require("torch")
    if isinstance(output, (tuple, list)) and output:
        output = output[0]
    if not isinstance(output, torch.Tensor):
        raise ConfigError(f"image encoder returned {type(output).__name__}; expected a tensor (N, C, h, w) or (N, C)")
    if output.ndim == 4:
        return output.float().permute(0, 2, 3, 1)
    if output.ndim == 2:
        return output.float()[:, None, None, :]
    raise ConfigError(
        f"image encoder output has shape {tuple(output.shape)}; expected a feature map (N, C, h, w) or a vector (N, C)"
    )
