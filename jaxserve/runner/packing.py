"""Packing: a StepBatch's narrow arrays (everything of [T], [R] or [R, P] shape) as views of two flat
buffers, one of 4-byte words (int32, uint32 and float32 by their bits) and one of booleans, so a step sends
them as two arrays (`PackedBatch`) and the step unpacks them by static slices: a call's argument handling
and host-to-device copies cost per array, and a StepBatch has 25 of them.
"""

import functools
import threading
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.runner.buckets import Bucket
from jaxserve.runner.step_batch import BatchLayout, StepBatch, separate_neutral_batch

# Inputs a step sends whole rather than in the packed buffers: the previous step's samples (already on the
# device) and the [R, vocabulary]-proportional sampling inputs (shared read-only arrays most steps).
_HELD_WHOLE = frozenset({"previous_tokens", "bias_token_ids", "bias_values", "token_bitmask"})
_WORDS, _FLAGS, _HELD = "words", "flags", "held"


@dataclass(frozen=True)
class _LeafSpec:
    """One StepBatch leaf: in which buffer, where, and what it is."""

    buffer: str  # _WORDS, _FLAGS or _HELD
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # into its buffer
    size: int  # elements


@dataclass(frozen=True, eq=False)  # compared by identity: one per bucket and layout (`batch_packing`)
class BatchPacking:
    """Where each leaf of a bucket's StepBatch sits: a static part of the step's inputs."""

    treedef: Any  # of StepBatch
    leaves: tuple[_LeafSpec, ...]  # in tree order
    num_words: int
    num_flags: int


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PackedBatch:
    """A StepBatch as the step receives it (`pack`, `unpack`)."""

    words: jax.Array  # i32[W]: the batch's 4-byte narrow arrays end to end
    flags: jax.Array  # bool[F]: its boolean arrays end to end
    held: tuple[jax.Array, ...]  # the inputs sent whole, in tree order
    packing: BatchPacking = field(metadata=dict(static=True))


_packings: dict[tuple[Bucket, BatchLayout], BatchPacking] = {}
_packings_lock = threading.Lock()  # the engine thread and a background warm-up's compile threads ask at once


def batch_packing(bucket: Bucket, layout: BatchLayout) -> BatchPacking:
    """The bucket's packing: one object per bucket and layout for the process's life, since a compiled step
    accepts only the very packing it was compiled with."""
    key = (bucket, layout)
    packing = _packings.get(key)
    if packing is None:
        with _packings_lock:
            packing = _packings.setdefault(key, _new_packing(bucket, layout))
    return packing


def _new_packing(bucket: Bucket, layout: BatchLayout) -> BatchPacking:
    template = separate_neutral_batch(bucket, layout)
    paths_and_leaves, treedef = jax.tree_util.tree_flatten_with_path(template)
    specs, sizes = [], {_WORDS: 0, _FLAGS: 0, _HELD: 0}
    for path, leaf in paths_and_leaves:
        name = path[-1].name
        buffer = _HELD if name in _HELD_WHOLE else _FLAGS if leaf.dtype == np.bool_ else _WORDS
        if buffer == _WORDS and leaf.dtype.itemsize != 4:
            raise TypeError(f"StepBatch.{name}: {leaf.dtype} is neither 4 bytes wide nor boolean")
        specs.append(_LeafSpec(buffer, leaf.dtype, leaf.shape, sizes[buffer], leaf.size))
        sizes[buffer] += leaf.size if buffer != _HELD else 1
    return BatchPacking(treedef, tuple(specs), sizes[_WORDS], sizes[_FLAGS])


def pack(batch: StepBatch, bucket: Bucket, layout: BatchLayout) -> PackedBatch:
    """The bucket's batch as the step takes it: its two buffers and its whole inputs. A batch from
    `neutral_batch` is packed already: its narrow arrays are views of the buffers, written in place (never
    replaced by other views of them). Any other batch (unpickled, or with an array replaced) is copied into
    new buffers."""
    packing = batch_packing(bucket, layout)
    leaves = jax.tree.leaves(batch)
    buffers: dict[str, np.ndarray | None] = {_WORDS: None, _FLAGS: None}
    held = []
    for spec, leaf in zip(packing.leaves, leaves, strict=True):
        if spec.buffer == _HELD:
            held.append(leaf)
            continue
        if buffers[spec.buffer] is None:
            buffers[spec.buffer] = leaf.base
        if leaf.base is None or leaf.base is not buffers[spec.buffer]:
            return _copy_packed(leaves, packing)
    words, flags = buffers[_WORDS], buffers[_FLAGS]
    if words.size != packing.num_words or flags.size != packing.num_flags:
        return _copy_packed(leaves, packing)
    return PackedBatch(words, flags, tuple(held), packing)


def _copy_packed(leaves: list[np.ndarray], packing: BatchPacking) -> PackedBatch:
    words, flags, held = [], [], []
    for spec, leaf in zip(packing.leaves, leaves, strict=True):
        if spec.buffer == _HELD:
            held.append(leaf)
            continue
        if leaf.dtype != spec.dtype or leaf.shape != spec.shape:
            raise TypeError(f"a batch array is {leaf.dtype}{list(leaf.shape)}, not {spec.dtype}{list(spec.shape)}")
        if spec.buffer == _WORDS:
            words.append(np.ravel(leaf).view(np.int32))  # by their bits: concatenating would convert them
        else:
            flags.append(np.ravel(leaf))
    return PackedBatch(np.concatenate(words), np.concatenate(flags), tuple(held), packing)


def unpack(packed: PackedBatch) -> StepBatch:
    """Inside the step: the StepBatch again, its narrow arrays as static slices of the buffers."""
    held = iter(packed.held)
    leaves = []
    for spec in packed.packing.leaves:
        if spec.buffer == _HELD:
            leaves.append(next(held))
            continue
        end = spec.offset + spec.size
        if spec.buffer == _FLAGS:
            leaves.append(packed.flags[spec.offset : end].reshape(spec.shape))
            continue
        x = packed.words[spec.offset : end]
        if spec.dtype != np.int32:
            x = jax.lax.bitcast_convert_type(x, jnp.dtype(spec.dtype))
        leaves.append(x.reshape(spec.shape))
    return jax.tree.unflatten(packed.packing.treedef, leaves)


def neutral_batch(bucket: Bucket, layout: BatchLayout) -> StepBatch:
    """A batch of padding: no tokens, no requests, every feature switched off (numpy). Its narrow arrays
    are views of two fresh buffers (`pack`), written in place by the builder; the wide ones are shared
    and copied before a write."""
    packing = batch_packing(bucket, layout)
    words, flags, held = _neutral_buffers(bucket, layout)
    words, flags, held = words.copy(), flags.copy(), iter(held)
    leaves = []
    for spec in packing.leaves:
        if spec.buffer == _HELD:
            leaves.append(next(held))
        else:
            buffer = words if spec.buffer == _WORDS else flags
            leaves.append(buffer[spec.offset : spec.offset + spec.size].view(spec.dtype).reshape(spec.shape))
    return jax.tree.unflatten(packing.treedef, leaves)


@functools.cache
def _neutral_buffers(bucket: Bucket, layout: BatchLayout) -> tuple[np.ndarray, np.ndarray, tuple]:
    """The neutral batch's two buffers and whole inputs, read-only: each batch starts from copies."""
    packed = _copy_packed(jax.tree.leaves(separate_neutral_batch(bucket, layout)), batch_packing(bucket, layout))
    for array in (packed.words, packed.flags, *packed.held):
        array.flags.writeable = False
    return packed.words, packed.flags, packed.held


