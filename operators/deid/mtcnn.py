"""MTCNN face detection in NumPy: the still model of ``deid.faces``, without torch.

MTCNN (Zhang et al., 2016, "Joint Face Detection and Alignment using Multi-task Cascaded
Convolutional Networks") is three small CNNs: P-Net slides over an image pyramid and proposes
boxes, R-Net (24x24 crops) and O-Net (48x48 crops) re-score and refine them. The weights are
the ones facenet-pytorch ships (``facenet_pytorch/data/{p,r,o}net.pt``), read here without
importing torch or facenet-pytorch: importing those cost an ingest actor ~3 CPU s (torch,
torchvision, sympy) and 174 MiB of RSS (the NumPy model: 9 MiB), for a model that runs on a
stream's last frame and on stills.

The cascade follows facenet-pytorch's ``detect_face`` step for step (pyramid from
``min_face``/``factor``, area resampling, per-scale NMS 0.5 then 0.7, box regression, squaring,
NMS 0.7 after R-Net and "min"-overlap NMS 0.7 after O-Net), so the boxes are that library's
within float rounding (``tests/unit/test_mtcnn.py`` compares them). Your own weights: a folder
with the three files (the same layers, torch's legacy format) in ``$MODALIGN_MTCNN_WEIGHTS``.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from modalign.operators.dependencies import PACKAGES

WEIGHTS_ENV = "MODALIGN_MTCNN_WEIGHTS"
NETS = ("pnet", "rnet", "onet")
FACTOR = 0.709  # pyramid step (facenet-pytorch's default)
STAGE_NMS = (0.5, 0.7, 0.7, 0.7)  # P-Net per scale, P-Net overall, R-Net, O-Net ("min" overlap)
_DTYPES = {"FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16,
           "LongStorage": np.int64, "IntStorage": np.int32}


def default_weights() -> Path:
    """The folder of the three nets' weights: ``$MODALIGN_MTCNN_WEIGHTS``, else facenet-pytorch's data
    folder, found without importing it (its import loads torch). ``DependencyMissingError``, naming
    the folder, when a file is missing (checked at the face operator's setup, before any work)."""
    own = os.environ.get(WEIGHTS_ENV)
    if own:
        folder = Path(own)
    else:
        spec = importlib.util.find_spec("facenet_pytorch")
        if spec is None or not spec.submodule_search_locations:
            raise PACKAGES["facenet_pytorch"].error()
        folder = Path(next(iter(spec.submodule_search_locations))) / "data"
    missing = [n for n in NETS if not (folder / f"{n}.pt").is_file()]
    if missing:
        raise PACKAGES["facenet_pytorch"].error(f"MTCNN weights {', '.join(f'{n}.pt' for n in missing)} in {folder} "
                                                f"(facenet-pytorch's, or set {WEIGHTS_ENV} to a folder of your own)")
    return folder


# -- weights: torch's legacy (pre-zip) serialisation, read as plain data --------------------------
@dataclass
class _Storage:
    key: str
    dtype: type
    data: np.ndarray | None = None


@dataclass
class _Tensor:
    storage: _Storage
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    def array(self) -> np.ndarray:
        flat = self.storage.data
        item = flat.itemsize
        return np.lib.stride_tricks.as_strided(flat[self.offset:], self.shape,
                                               tuple(s * item for s in self.stride)).copy()


class _Unpickler(pickle.Unpickler):
    """Resolves only what a state dict of tensors holds; anything else is refused."""

    def __init__(self, f, storages: dict[str, _Storage]) -> None:
        super().__init__(f)
        self.storages = storages

    def find_class(self, module: str, name: str):
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, shape, stride, *_: _Tensor(storage, offset, tuple(shape), tuple(stride))
        if module == "torch" and name in _DTYPES:
            return name
        raise pickle.UnpicklingError(f"unexpected {module}.{name} in a weights file")

    def persistent_load(self, pid):
        kind, storage_type, key, _location, _numel, *_ = pid
        if kind != "storage" or storage_type not in _DTYPES:
            raise pickle.UnpicklingError(f"unexpected persistent id {kind}/{storage_type} in a weights file")
        return self.storages.setdefault(key, _Storage(key, _DTYPES[storage_type]))


def read_state_dict(path: Path) -> dict[str, np.ndarray]:
    """The tensors of a state dict that ``torch.save`` wrote in its legacy format, as arrays.

    That format is five pickles (magic number, protocol, system info, the object, the storage
    keys) followed by each storage: its element count (int64) and its bytes."""
    storages: dict[str, _Storage] = {}
    with open(path, "rb") as f:
        for _ in range(3):  # magic number, protocol version, system info
            pickle.load(f)
        state = _Unpickler(f, storages).load()
        for key in pickle.load(f):
            s = storages[key]
            n = int(np.frombuffer(f.read(8), "<i8")[0])
            s.data = np.frombuffer(f.read(n * np.dtype(s.dtype).itemsize), s.dtype)
            if len(s.data) != n:
                raise ValueError(f"{path}: truncated storage {key}")
    return {name: t.array() for name, t in state.items()}


# -- layers, on NHWC float32 arrays ------------------------------------------------------------
def _conv(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Valid 2-D convolution, stride 1; ``w`` is torch's (out, in, k, k)."""
    k = w.shape[2]
    n, h, wd, c = x.shape
    if k == 1:
        cols = x.reshape(-1, c)
    else:  # (n, h', w', c, k, k): the order of torch's weight layout
        cols = np.lib.stride_tricks.sliding_window_view(x, (k, k), axis=(1, 2)).reshape(-1, c * k * k)
    out = cols @ w.reshape(w.shape[0], -1).T
    out += b
    return out.reshape(n, h - k + 1, wd - k + 1, w.shape[0])


def _prelu(x: np.ndarray, a: np.ndarray) -> np.ndarray:
    """In place: x where positive, a * x (a per channel) elsewhere."""
    neg = np.minimum(x, 0.0)
    np.maximum(x, 0.0, out=x)
    neg *= a
    x += neg
    return x


def _pool(x: np.ndarray, k: int, s: int) -> np.ndarray:
    """Max pooling with torch's ``ceil_mode=True`` (a last, partial window counts)."""
    n, h, w, c = x.shape
    oh, ow = -(-(h - k) // s) + 1, -(-(w - k) // s) + 1
    ph, pw = (oh - 1) * s + k, (ow - 1) * s + k
    if (ph, pw) != (h, w):
        x = np.pad(x, ((0, 0), (0, ph - h), (0, pw - w), (0, 0)), constant_values=-np.inf)
    win = np.lib.stride_tricks.sliding_window_view(x, (k, k), axis=(1, 2))[:, ::s, ::s]
    return win.max(axis=(4, 5))


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _flatten(x: np.ndarray) -> np.ndarray:
    """(n, h, w, c) flattened as torch's R-/O-Net do (``permute(0, 3, 2, 1)`` of NCHW: w, h, c)."""
    return x.transpose(0, 2, 1, 3).reshape(len(x), -1)


class _Net:
    def __init__(self, state: dict[str, np.ndarray]) -> None:
        self.p = {k: v.astype(np.float32, copy=False) for k, v in state.items()}  # (read as copies already)

    def conv(self, x: np.ndarray, name: str) -> np.ndarray:
        return _conv(x, self.p[f"{name}.weight"], self.p[f"{name}.bias"])

    def dense(self, x: np.ndarray, name: str) -> np.ndarray:
        return x @ self.p[f"{name}.weight"].T + self.p[f"{name}.bias"]

    def prelu(self, x: np.ndarray, name: str) -> np.ndarray:
        return _prelu(x, self.p[f"{name}.weight"])


class _PNet(_Net):
    def __call__(self, x):  # -> (box regression (n, h, w, 4), face probability (n, h, w))
        x = _pool(self.prelu(self.conv(x, "conv1"), "prelu1"), 2, 2)
        x = self.prelu(self.conv(x, "conv2"), "prelu2")
        x = self.prelu(self.conv(x, "conv3"), "prelu3")
        return self.conv(x, "conv4_2"), _softmax(self.conv(x, "conv4_1"))[..., 1]


class _RNet(_Net):
    def __call__(self, x):
        x = _pool(self.prelu(self.conv(x, "conv1"), "prelu1"), 3, 2)
        x = _pool(self.prelu(self.conv(x, "conv2"), "prelu2"), 3, 2)
        x = self.prelu(self.dense(_flatten(self.prelu(self.conv(x, "conv3"), "prelu3")), "dense4"), "prelu4")
        return self.dense(x, "dense5_2"), _softmax(self.dense(x, "dense5_1"))[:, 1]


class _ONet(_Net):
    def __call__(self, x):
        x = _pool(self.prelu(self.conv(x, "conv1"), "prelu1"), 3, 2)
        x = _pool(self.prelu(self.conv(x, "conv2"), "prelu2"), 3, 2)
        x = _pool(self.prelu(self.conv(x, "conv3"), "prelu3"), 2, 2)
        x = self.prelu(self.dense(_flatten(self.prelu(self.conv(x, "conv4"), "prelu4")), "dense5"), "prelu5")
        return self.dense(x, "dense6_2"), _softmax(self.dense(x, "dense6_1"))[:, 1]


# -- the cascade ---------------------------------------------------------------------------------
class _Integral:
    """Box means of an image by its summed-area table: torch's ``interpolate(mode="area")``
    (adaptive average pooling: output cell i averages input rows floor(i*in/out) to
    ceil((i+1)*in/out)) of any crop, at any size, up or down."""

    def __init__(self, rgb: np.ndarray) -> None:
        import cv2

        h, w = rgb.shape[:2]
        if h * w * 255 < 2**31:  # int32 holds every sum (up to 4K frames): half float64's bytes to gather
            self.sat = cv2.integral(np.ascontiguousarray(rgb), sdepth=cv2.CV_32S)
        else:
            self.sat = cv2.integral(np.ascontiguousarray(rgb), sdepth=cv2.CV_64F)

    def resample(self, y0: int, y1: int, x0: int, x1: int, oh: int, ow: int) -> np.ndarray:
        """The crop ``[y0:y1, x0:x1]`` area-resampled to (oh, ow), normalised as MTCNN wants."""
        ih, iw = y1 - y0, x1 - x0
        i, j = np.arange(oh), np.arange(ow)
        ys, ye = y0 + i * ih // oh, y0 + -(-(i + 1) * ih // oh)
        xs, xe = x0 + j * iw // ow, x0 + -(-(j + 1) * iw // ow)
        rows = self.sat[ye] - self.sat[ys]
        total = (rows[:, xe] - rows[:, xs]).astype(np.float64)
        mean = total / ((ye - ys)[:, None, None] * (xe - xs)[None, :, None])
        return ((mean - 127.5) * 0.0078125).astype(np.float32)


def _nms(boxes: np.ndarray, scores: np.ndarray, threshold: float, smaller: bool = False) -> np.ndarray:
    """Greedy non-maximum suppression; indices kept, best first. Overlap is IoU on the boxes'
    real extent (torchvision's ``nms``), or with ``smaller`` intersection over the smaller box
    on the pixel-inclusive extent (+1), as facenet-pytorch's last stage does."""
    if not len(boxes):
        return np.zeros(0, np.int64)
    x0, y0, x1, y1 = boxes[:, 0], boxes[:, 1], boxes[:, 2], boxes[:, 3]
    one = 1.0 if smaller else 0.0
    area = (x1 - x0 + one) * (y1 - y0 + one)
    order = np.argsort(-scores, kind="stable")
    keep = []
    while len(order):
        i, rest = order[0], order[1:]
        keep.append(i)
        w = np.maximum(0.0, np.minimum(x1[i], x1[rest]) - np.maximum(x0[i], x0[rest]) + one)
        h = np.maximum(0.0, np.minimum(y1[i], y1[rest]) - np.maximum(y0[i], y0[rest]) + one)
        inter = w * h
        over = inter / (np.minimum(area[i], area[rest]) if smaller else area[i] + area[rest] - inter)
        order = rest[over <= threshold]
    return np.asarray(keep, np.int64)


def _square(b: np.ndarray) -> np.ndarray:
    """Each box grown to a square around its centre (its longer side)."""
    w, h = b[:, 2] - b[:, 0], b[:, 3] - b[:, 1]
    side = np.maximum(w, h)
    b[:, 0] += w * 0.5 - side * 0.5
    b[:, 1] += h * 0.5 - side * 0.5
    b[:, 2] = b[:, 0] + side
    b[:, 3] = b[:, 1] + side
    return b


def _regress(b: np.ndarray, reg: np.ndarray, plus_one: bool = True) -> np.ndarray:
    one = 1.0 if plus_one else 0.0
    w, h = b[:, 2] - b[:, 0] + one, b[:, 3] - b[:, 1] + one
    b[:, :4] += reg * np.stack([w, h, w, h], axis=1)
    return b


class Mtcnn:
    """``detect(rgb)`` -> (boxes (n, 4) as x0, y0, x1, y1 in pixels, largest first; O-Net scores)."""

    def __init__(self, min_face: int = 20, thresholds: tuple[float, float, float] = (0.6, 0.7, 0.7),
                 factor: float = FACTOR, weights: Path | None = None) -> None:
        folder = Path(weights) if weights is not None else default_weights()
        self.pnet, self.rnet, self.onet = (cls(read_state_dict(folder / f"{name}.pt"))
                                           for cls, name in zip((_PNet, _RNet, _ONet), NETS))
        self.min_face, self.thresholds, self.factor = min_face, thresholds, factor

    def detect(self, rgb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        h, w = rgb.shape[:2]
        img = _Integral(rgb)
        b = self._propose(img, h, w)
        for stage, (net, size) in enumerate(((self.rnet, 24), (self.onet, 48)), start=1):
            if not len(b):
                break
            b, crops = self._crops(img, b, h, w, size)
            reg, score = net(crops)
            ok = score > self.thresholds[stage]
            b = np.concatenate([b[ok, :4], score[ok, None]], axis=1)
            reg = reg[ok]
            if stage == 1:
                keep = _nms(b[:, :4], b[:, 4], STAGE_NMS[2])
                b = _square(_regress(b[keep], reg[keep]))
            else:
                b = _regress(b, reg)
                b = b[_nms(b[:, :4], b[:, 4], STAGE_NMS[3], smaller=True)]
        if not len(b):
            return np.zeros((0, 4), np.float32), np.zeros(0, np.float32)
        b = b[np.argsort((b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1]))[::-1]]
        return b[:, :4].astype(np.float32), b[:, 4].astype(np.float32)

    def _propose(self, img: _Integral, h: int, w: int) -> np.ndarray:
        """P-Net over the pyramid: candidate boxes (x0, y0, x1, y1, score), regressed and squared."""
        scale, side = 12.0 / self.min_face, min(h, w) * 12.0 / self.min_face
        found = []
        while side >= 12:
            reg, prob = self.pnet(img.resample(0, h, 0, w, int(h * scale + 1), int(w * scale + 1))[None])
            _, yy, xx = np.nonzero(prob >= self.thresholds[0])
            if len(yy):
                cells = np.stack([xx, yy], axis=1).astype(np.float32)
                b = np.concatenate([np.floor((2 * cells + 1) / scale), np.floor((2 * cells + 12) / scale),
                                    prob[0, yy, xx, None], reg[0, yy, xx]], axis=1)
                found.append(b[_nms(b[:, :4], b[:, 4], STAGE_NMS[0])])
            scale *= self.factor
            side *= self.factor
        if not found:
            return np.zeros((0, 5), np.float32)
        b = np.concatenate(found)
        b = b[_nms(b[:, :4], b[:, 4], STAGE_NMS[1])]
        return _square(_regress(b[:, :5].copy(), b[:, 5:9], plus_one=False))

    @staticmethod
    def _crops(img: _Integral, b: np.ndarray, h: int, w: int, size: int) -> tuple[np.ndarray, np.ndarray]:
        """The boxes that overlap the image and their crops (clipped to it) resampled to size x size."""
        t = np.trunc(b[:, :4]).astype(np.int64)
        x0, y0 = np.maximum(t[:, 0], 1), np.maximum(t[:, 1], 1)
        x1, y1 = np.minimum(t[:, 2], w), np.minimum(t[:, 3], h)
        ok = (y1 > y0 - 1) & (x1 > x0 - 1)
        crops = [img.resample(y0[k] - 1, y1[k], x0[k] - 1, x1[k], size, size) for k in np.flatnonzero(ok)]
        return b[ok], np.stack(crops) if crops else np.zeros((0, size, size, 3), np.float32)
