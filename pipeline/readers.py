"""The aligned samples of ``pipeline.dataset`` for training frameworks: PyTorch, Ray Data, Hugging Face.

Each reader hands on the batches of the Ray-free join; none of them joins anything itself. torch,
Ray and ``datasets`` are imported inside the functions, so importing this module loads none of them.

- ``torch_dataset``: an ``IterableDataset`` that shards the work items (one session's chunk of
  samples each) over every DataLoader worker of every rank: item ``j`` goes to shard
  ``j mod (world_size * num_workers)``, so each sample is read once, by one worker, and no
  sample is missed. ``rank``/``world_size`` default to ``torch.distributed`` when it is
  initialised. Numeric columns are ``torch.from_numpy`` views of the batch's buffers.
- ``ray_dataset``: one Ray task per work item (``map_batches`` over the item list), so the
  join runs wherever the cluster schedules it; each task reads OUT itself.
- ``hf_dataset``: ``datasets.Dataset.from_generator`` over the same rows, with the features of the
  batch's plain Arrow schema (lists of structs, nested fixed-size lists; no maps).
"""

from __future__ import annotations

from typing import Any, Iterator

import pyarrow as pa

from modalign.pipeline.dataset import (EVEN_MODES, AlignedSpec, Context, WorkItem, context, even_shard_items,
                                       iter_batches, iter_samples, plain_batch, rows_of, shard_items, shard_of,
                                       with_spec)
from modalign.schemas.errors import ConfigError

_TORCH_CLASS: Any = None


def _distributed() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _torch_class() -> type:
    """The ``IterableDataset`` subclass, defined on first use (torch loads here, not at import)."""
    global _TORCH_CLASS
    if _TORCH_CLASS is not None:
        return _TORCH_CLASS
    import torch
    from torch.utils.data import IterableDataset, get_worker_info

    class AlignedIterableDataset(IterableDataset):
        """Aligned samples of one ``Output``, sharded by rank and DataLoader worker (see the module)."""

        def __init__(self, ctx: Context, rank: int | None = None, world_size: int | None = None,
                     even: str | None = None) -> None:
            if even is not None and even not in EVEN_MODES:
                raise ConfigError(f"even: one of {', '.join(EVEN_MODES)} or None, got {even!r}")
            self.ctx = ctx
            self.rank = rank
            self.world_size = world_size
            self.even = even

        def shard(self) -> tuple[int, int]:
            """(index, count) of the calling worker among all workers of all ranks."""
            rank, world = self.rank, self.world_size
            if rank is None or world is None:
                r, w = _distributed()
                rank = r if rank is None else rank
                world = w if world is None else world
            info = get_worker_info()
            wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
            return shard_of(rank, world, wid, nw)

        def items(self) -> list[WorkItem]:
            if self.even is not None:
                return even_shard_items(self.ctx.items, *self.shard(), self.even)
            return shard_items(self.ctx.items, *self.shard())

        def __iter__(self) -> Iterator[dict]:
            ctx = self.ctx
            if get_worker_info() is not None and ctx.spec.decode_threads is None:
                ctx = with_spec(ctx, decode_threads=1)  # the workers are the parallelism: one decoder each
            return iter_samples(ctx, self.items(), tensor=torch.from_numpy)

        @property
        def num_samples(self) -> int:
            """Samples over all shards."""
            return sum(i.stop - i.first for i in self.ctx.items)

        def __reduce__(self):  # picklable for spawned workers although the class is made at run time
            return (_rebuild_torch, (self.ctx, self.rank, self.world_size, self.even))

    _TORCH_CLASS = AlignedIterableDataset
    return _TORCH_CLASS


def _rebuild_torch(ctx: Context, rank: int | None, world_size: int | None, even: str | None = None) -> Any:
    return _torch_class()(ctx, rank, world_size, even)


def torch_dataset(output: Any, rank: int | None = None, world_size: int | None = None, even: str | None = None,
                  **aligned: Any) -> Any:
    """A PyTorch ``IterableDataset`` of ``output.aligned(**aligned)`` samples (dicts of tensors,
    strings and lists), sharded by session chunk over ranks and DataLoader workers: each sample once.
    ``even="drop"`` or ``"pad"`` gives every worker of every rank the same number of samples instead
    (``even_shard_items``: fewer than ranks x workers samples left out, or seen twice), so every rank
    has the same number of batches, as distributed training needs. Batch it with ``collate`` (text
    blocks and vector lists vary in length per sample)."""
    return _torch_class()(context(output, AlignedSpec.make(**aligned)), rank, world_size, even)


def _adjacent(vals: list) -> Any:
    """One tensor over ``vals`` without a copy when they are consecutive equal-shaped views of one
    buffer (what ``torch_dataset`` yields within a block), else None."""
    v0 = vals[0]
    if not v0.is_contiguous():
        return None
    ptr, step = v0.untyped_storage().data_ptr(), v0.numel()
    for j, v in enumerate(vals):
        if (v.shape != v0.shape or v.dtype != v0.dtype or not v.is_contiguous()
                or v.untyped_storage().data_ptr() != ptr or v.storage_offset() != v0.storage_offset() + j * step):
            return None
    return v0.as_strided((len(vals), *v0.shape), (step, *v0.stride()), v0.storage_offset())


def collate(samples: list[dict]) -> dict:
    """A DataLoader ``collate_fn``: tensors of one shape as one batch tensor (in the loading process a
    view, not a copy, when the samples are adjacent in one buffer; in a worker stacked into shared
    memory, which is how a batch reaches the trainer), numbers as a tensor, the rest as lists."""
    import torch
    from torch.utils.data import default_collate, get_worker_info

    in_worker = get_worker_info() is not None
    out: dict[str, Any] = {}
    for k in samples[0]:
        vals = [s[k] for s in samples]
        v0 = vals[0]
        if isinstance(v0, torch.Tensor) and all(isinstance(v, torch.Tensor) and v.shape == v0.shape for v in vals):
            if in_worker:  # stacked straight into shared memory, as torch's own collate does for a worker
                out[k] = default_collate(vals)
                continue
            view = _adjacent(vals)
            out[k] = view if view is not None else torch.stack(vals)
        elif isinstance(v0, (bool, int, float)) and all(type(v) is type(v0) for v in vals):
            out[k] = torch.tensor(vals)
        else:
            out[k] = vals
    return out


class _JoinItems:
    """The Ray Data task body: rows ``{"item": j}`` -> the samples of work item ``j`` (a pyarrow table)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    def __call__(self, batch: pa.Table) -> pa.Table:
        items = [self.ctx.items[j] for j in batch.column("item").to_pylist()]
        batches = [plain_batch(b) for b in iter_batches(self.ctx, items)]
        if not batches:
            return pa.table({})
        return pa.Table.from_batches(batches)


def ray_dataset(output: Any, **aligned: Any) -> Any:
    """A Ray Data ``Dataset`` of ``output.aligned(**aligned)`` rows: one task per work item (a session's
    chunk), run wherever the cluster puts it; OUT must be readable there (s3://, or a shared path).
    Tensor columns come as nested fixed-size lists (``plain_batch``)."""
    import ray

    ctx = context(output, AlignedSpec.make(**aligned))
    n = len(ctx.items)
    if n == 0:
        return ray.data.from_items([])
    ds = ray.data.from_items([{"item": j} for j in range(n)], override_num_blocks=n)
    return ds.map_batches(_JoinItems(ctx), batch_size=1, batch_format="pyarrow")


def _hf_rows(ctx: Context, items: list[WorkItem]) -> Iterator[dict]:
    for b in iter_batches(ctx, items):
        yield from rows_of(plain_batch(b))


def hf_dataset(output: Any, cache_dir: str | None = None, **aligned: Any) -> Any:
    """A Hugging Face ``datasets.Dataset`` of ``output.aligned(**aligned)`` rows (``decode`` defaults to
    False here: JPEG bytes, which ``datasets.Image()`` decodes lazily), built with
    ``Dataset.from_generator`` and the features of the batch's plain schema (no map columns)."""
    import datasets

    aligned.setdefault("decode", False)
    ctx = context(output, AlignedSpec.make(**aligned))
    first = next(iter_batches(ctx, ctx.items[:1]), None)
    features = None if first is None else datasets.Features.from_arrow_schema(plain_batch(first).schema)
    return datasets.Dataset.from_generator(_hf_rows, features=features, cache_dir=cache_dir,
                                           gen_kwargs={"ctx": ctx, "items": ctx.items})
