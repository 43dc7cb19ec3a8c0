"""Tensor parallelism with `jax.sharding`: the device mesh, how each weight is split, and the head layout.

Megatron-style: attention heads and the MLP's intermediate width are split across the mesh's one axis
(`tp`), as are the vocabulary rows of the embedding and the LM head; norms and position tables are
replicated. XLA inserts the all-reduces after the output and down projections. The KV pages are split by
KV head, and attention runs per shard under `shard_map` (`jaxserve.models.layers.paged_attention`), so
each device reads only its own pages; logits are gathered before sampling.

Heads that do not split evenly are laid out so that they do, before the weights reach the devices
(`HeadLayout`): KV heads are replicated when there are fewer than devices or their count does not divide
by the device count (as vLLM does), and query heads are padded with zero heads (a zero query row reads
nothing that matters, and its zero output-projection rows add nothing), so SmolLM2's 9 query / 3 KV heads
run on 2 or 4 devices with the same results. With one device, nothing here changes anything.
"""

import math
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

TP_AXIS = "tp"

# How a parameter splits, by its name in the model (the last part of its path): (axis, heads), where axis
# is the one split over `tp` (None: replicated) and heads says what that axis holds: "q" (query heads),
# "kv" (KV heads), "qkv" (q, k and v stacked on the axis before it), or None (not heads: F or V).
SplitRule = tuple[int | None, str | None]


def make_mesh(tensor_parallel_size: int) -> Mesh | None:
    """A 1-D mesh over the first `tensor_parallel_size` local devices; None for one device."""
    if tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {tensor_parallel_size}")
    if tensor_parallel_size == 1:
        return None
    devices = jax.devices()
    if jax.process_count() > 1 and tensor_parallel_size != len(devices):
        raise ValueError(f"with {jax.process_count()} processes, --tensor-parallel-size must count every "
                         f"process's devices ({len(devices)}), got {tensor_parallel_size}")
    if len(devices) < tensor_parallel_size:
        hint = (f"; on CPU, XLA_FLAGS=--xla_force_host_platform_device_count={tensor_parallel_size} makes "
                "that many CPU devices" if devices[0].platform == "cpu" else "")
        raise ValueError(f"--tensor-parallel-size {tensor_parallel_size} needs {tensor_parallel_size} devices; "
                         f"this process sees {len(devices)} ({devices[0].platform}){hint}")
    return Mesh(np.asarray(devices[:tensor_parallel_size]), (TP_AXIS,))


def on_one_device(device: jax.Device) -> jax.sharding.Sharding:
    """The sharding that places whole arrays on `device`: jax's constructor for it where jax has one (0.10
    on; jax 0.12.1 deprecates the name `jax.sharding.SingleDeviceSharding`), the class itself before."""
    make = getattr(jax.sharding, "make_single_device_sharding", None)
    return make(device) if make is not None else jax.sharding.SingleDeviceSharding(device)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def split_along(mesh: Mesh, ndim: int, axis: int | None) -> NamedSharding:
    """The sharding that splits `axis` of an `ndim`-D array over the mesh (replicated for None)."""
    spec = [None] * ndim
    if axis is not None:
        spec[axis] = TP_AXIS
    return NamedSharding(mesh, PartitionSpec(*spec))


def page_array_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """Where one of a KV cache's page arrays lives over the mesh: K/V pages [K, pages, page_size, H] split by
    KV head (which `HeadLayout` makes divide); a page array of hidden states [1, pages, page_size, F]
    (`models/features.py`) split along F where that divides, else whole on every device."""
    for axis in (0, len(shape) - 1):
        if shape[axis] % mesh.size == 0:
            return split_along(mesh, len(shape), axis)
    return replicated(mesh)


def constrain_pages(kv_caches: Any, mesh: Mesh) -> Any:
    """A step's KV cache held where the runner keeps it (`page_array_sharding`), inside a jitted step."""
    return jax.tree.map(lambda pages: jax.lax.with_sharding_constraint(pages, page_array_sharding(mesh, pages.shape)),
                        kv_caches)


def bytes_per_device(leaves: list[jax.ShapeDtypeStruct | jax.Array]) -> int:
    """One device's share of placed arrays: each one's shard, a replicated or unplaced (None) one whole."""
    return sum(math.prod(x.shape if x.sharding is None else x.sharding.shard_shape(x.shape))
               * np.dtype(x.dtype).itemsize for x in leaves)


def param_sharding(mesh: Mesh, shape: tuple[int, ...], rule: SplitRule) -> NamedSharding:
    """Where a parameter of `shape` lives: split along its rule's axis when that divides evenly, else
    replicated (a vocabulary like GPT-2's 50,257 rows; heads always divide after `HeadLayout`)."""
    axis, _ = rule
    if axis is not None and shape[axis] % mesh.size:
        axis = None
    return split_along(mesh, len(shape), axis)


@dataclass(frozen=True)
class HeadLayout:
    """Query and KV heads rearranged so that both split evenly over `tp` devices.

    Each KV head is replicated `kv_replicas` times (the least count that makes the KV heads a multiple
    of `tp`); each replica serves `group_eff` query slots, and the query heads of the original group
    are spread over its replicas in order, the slots left over holding zero heads. Query slot s reads
    KV slot `s // group_eff`, which keeps the models' GQA rule (query head i reads KV head
    `i // group`) intact, and device d's query slots read exactly device d's KV slots.
    """

    num_heads: int
    num_kv_heads: int
    tp: int

    @property
    def kv_replicas(self) -> int:
        return math.lcm(self.num_kv_heads, self.tp) // self.num_kv_heads

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def group_eff(self) -> int:
        return -(-self.group // self.kv_replicas)

    @property
    def num_kv_heads_eff(self) -> int:
        return self.num_kv_heads * self.kv_replicas

    @property
    def num_heads_eff(self) -> int:
        return self.num_kv_heads_eff * self.group_eff

    @property
    def is_identity(self) -> bool:
        return self.num_heads_eff == self.num_heads and self.num_kv_heads_eff == self.num_kv_heads

    def query_slots(self) -> np.ndarray:  # i64[N]: the slot of each original query head
        heads = np.arange(self.num_heads)
        kv_head, within = heads // self.group, heads % self.group
        replica = within // self.group_eff
        return (kv_head * self.kv_replicas + replica) * self.group_eff + within % self.group_eff

    def kv_sources(self) -> np.ndarray:  # i64[K_eff]: the original KV head of each KV slot
        return np.arange(self.num_kv_heads_eff) // self.kv_replicas

    def apply(self, heads: str | None, value: np.ndarray, axis: int | None) -> np.ndarray:
        """`value` with its head axis laid out for the mesh (a parameter's `SplitRule` names the axis)."""
        if heads is None or axis is None or self.is_identity:
            return value
        if heads == "kv":
            return np.take(value, self.kv_sources(), axis=axis)
        if heads == "q":
            shape = list(value.shape)
            shape[axis] = self.num_heads_eff
            padded = np.zeros(shape, value.dtype)
            index = [slice(None)] * value.ndim
            index[axis] = self.query_slots()
            padded[tuple(index)] = value
            return padded
        if heads == "qkv":  # [..., 3, heads, ...]: q padded, k and v replicated
            q, k, v = np.split(value, 3, axis=axis - 1)
            if self.num_heads_eff != self.num_kv_heads_eff:
                raise ValueError("a fused q/k/v tensor needs as many query as KV heads")
            return np.concatenate([self.apply("q", q, axis), self.apply("kv", k, axis),
                                   self.apply("kv", v, axis)], axis=axis - 1)
        raise ValueError(f"unknown head kind {heads!r}")
