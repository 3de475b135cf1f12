"""The key/value caches of the HF engine's decoding loop: a growing one stored in the compute dtype
(`rollout.hf_decode=dynamic`, `growing_cache`), and preallocated ones (`static` and `compiled`)
written in place, kept between decoding calls, each layer's values in their own dtype."""

from __future__ import annotations

import functools

import torch


class StaticCachePool:
    """Preallocated caches kept between decoding calls, one per (rows, length, dtype), the `size`
    most recently used: a compiled step replays its CUDA graph only over the cache tensors it was
    captured with, so a cache made anew every rollout would have the graph re-recorded every rollout
    (inferred from how CUDA-graph trees treat static inputs; not seen on a GPU).
    A cache taken again is zeroed first. Held memory: up to `size` caches (SmolLM2, 64 rows of 128
    positions in bf16: 0.19 GB each)."""

    def __init__(self, size: int = 4):
        self.size = size
        self.caches: dict[tuple, object] = {}  # insertion order: least recently used first

    def take(self, model, rows: int, length: int):
        weight = next(model.parameters())
        autocast = torch.is_autocast_enabled(weight.device.type)
        compute = torch.get_autocast_dtype(weight.device.type) if autocast else None
        key = (rows, length, weight.device, weight.dtype, compute)
        cache = self.caches.pop(key, None)
        if cache is None:
            cache = preallocated_cache(model.config, length)
        else:
            cache.reset()
        self.caches[key] = cache
        while len(self.caches) > self.size:
            self.caches.pop(next(iter(self.caches)))
        return cache


def growing_cache(config, capacity: int | None = None):
    """transformers' `DynamicCache`, its plain layers storing keys and values in the autocast dtype,
    and with a `capacity` (positions: prompt and new tokens) written into buffers preallocated once.

    Under CPU bf16 autocast a Llama/Qwen2 layer's keys come out float32 (the rotary embedding is
    applied in float32), and a plain layer's first concatenation promotes its bf16 values to float32
    too, so the cache held float32 and every decoding step cast all of it back to bf16 for the
    attention's matrix products (autocast casts the inputs of matmul and of sdpa): in SmolLM2's
    rollout, 0.42 s of a 4.8 s call in 4-d copies. Stored in bf16 the attention reads the same
    values (the rounding autocast would do, done once), half the bytes, and nothing is cast again.

    With a `capacity` each layer writes every token into its buffers instead of concatenating a new
    copy of the cache at every token, and rows that leave (`batch_select_indices`) move to the front
    in place; the attention reads views of the rows and positions filled, the same values and shapes
    as without. A concatenating cache allocates a new size at every token and every leaving, which
    under `keep_freed_memory` (no heap trimming) fragments the heap: a rollout's buffers have one
    size per capacity, which the next rollout reuses."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    layer_class = compute_dtype_dynamic_layer()
    cache = DynamicCache(config=config)
    cache.layers = [
        layer_class(capacity=capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers
    ]
    return cache


@functools.cache
def compute_dtype_dynamic_layer() -> type:
    """The layer of `growing_cache`, one class for the process (as `per_dtype_static_layer`)."""
    from transformers.cache_utils import DynamicLayer

    class ComputeDtypeDynamicLayer(DynamicLayer):
        def __init__(self, capacity: int | None = None, **kwargs):
            super().__init__(**kwargs)
            self.capacity = capacity  # None: concatenate, as DynamicLayer does
            self.rows = self.length = 0  # with a capacity: the buffers' rows and positions in use

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            device = key_states.device.type
            if torch.is_autocast_enabled(device):  # what autocast would cast them to at every step
                dtype = torch.get_autocast_dtype(device)
                key_states, value_states = key_states.to(dtype), value_states.to(dtype)
            if self.capacity is None:
                return super().update(key_states, value_states, *args, **kwargs)
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
                self._allocate(key_states, value_states, rows=key_states.shape[0])
            start, end = self.length, self.length + key_states.shape[-2]
            if end > self.capacity:
                raise ValueError(f"a growing cache of capacity {self.capacity} was given position {end}")
            self.key_buffer[: self.rows, :, start:end] = key_states  # [r, heads, t, d]
            self.value_buffer[: self.rows, :, start:end] = value_states
            self.length = end
            return self._views()

        def _allocate(self, keys: torch.Tensor, values: torch.Tensor, *, rows: int) -> None:
            heads = keys.shape[1]
            self.key_buffer = keys.new_empty(rows, heads, self.capacity, keys.shape[-1])  # [b, heads, L, d]
            self.value_buffer = values.new_empty(rows, heads, self.capacity, values.shape[-1])
            self.rows = rows

        def _views(self) -> tuple[torch.Tensor, torch.Tensor]:
            self.keys = self.key_buffer[: self.rows, :, : self.length]  # [r, heads, T, d]
            self.values = self.value_buffer[: self.rows, :, : self.length]
            return self.keys, self.values

        def batch_repeat_interleave(self, repeats: int) -> None:
            if self.capacity is None or self.length == 0:
                return super().batch_repeat_interleave(repeats)
            keys, values = self._views()
            self._allocate(keys, values, rows=self.rows * repeats)
            self.key_buffer[:, :, : self.length] = keys.repeat_interleave(repeats, dim=0)
            self.value_buffer[:, :, : self.length] = values.repeat_interleave(repeats, dim=0)
            self._views()

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if self.capacity is None or self.length == 0:
                return super().batch_select_indices(indices)
            rows = len(indices)  # the rows kept move to the front: a copy of them, then written back
            self.key_buffer[:rows, :, : self.length] = self.key_buffer[indices, :, : self.length]
            self.value_buffer[:rows, :, : self.length] = self.value_buffer[indices, :, : self.length]
            self.rows = rows
            self._views()

    return ComputeDtypeDynamicLayer


def preallocated_cache(config, length: int):
    """transformers' `StaticCache` of `length` positions, each layer's values in their own dtype.

    Under CPU autocast a Llama/Qwen2 layer's keys come out float32 (the rotary embedding is applied
    in float32) and its values bf16; `StaticLayer` allocates both in the keys' dtype and then
    refuses the values. Preallocated, the cache is written in place: a plain growing
    (`DynamicCache`) one concatenates a new copy of every layer at every token, and with freed
    memory kept in the process (`keep_freed_memory`) the heap grew by their sum (SmolLM2 LoRA, 200
    held-out rows: +9 GB in one validation); `growing_cache` with a capacity now avoids that too."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    layer_class = per_dtype_static_layer()
    cache = StaticCache(config=config, max_cache_len=length)
    cache.layers = [
        layer_class(max_cache_len=layer.max_cache_len) if type(layer) is StaticLayer else layer
        for layer in cache.layers
    ]
    return cache


@functools.cache
def per_dtype_static_layer() -> type:
    """The cache layer of `preallocated_cache`, one class for the process: a compiled step guards
    on its layers' type, and a class made anew for every cache made each rollout recompile (seen on
    an H200: 6 s per SmolLM2 step, every one a compilation)."""
    from transformers.cache_utils import StaticLayer

    class PerDtypeStaticLayer(StaticLayer):
        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            super().lazy_initialization(key_states, value_states)
            if self.values.dtype != value_states.dtype:
                self.values = torch.zeros_like(self.values, dtype=value_states.dtype)
                torch._dynamo.mark_static_address(self.values)  # as StaticLayer marks its own

        def fill_repeated(self, source: StaticLayer, repeats: int) -> None:
            """Each of `source`'s g rows written `repeats` times into this layer's g * repeats rows,
            in place: a compiled step's CUDA graph reads the cache at the addresses it was captured
            with (new tensors unmarked as static made inductor skip the graphs: "mutated inputs",
            seen on an H200)."""
            g, heads, _, k_dim = source.keys.shape
            v_dim = source.values.shape[-1]
            if not self.is_initialized:  # (reads only the shapes and dtypes: no copy of the prefill)
                rows = g * repeats
                self.lazy_initialization(source.keys.new_empty(rows, heads, 0, k_dim),
                                         source.values.new_empty(rows, heads, 0, v_dim))  # fmt: skip
            self.keys.view(g, repeats, *self.keys.shape[1:]).copy_(source.keys[:, None])  # [g, n, h, L, d]
            self.values.view(g, repeats, *self.values.shape[1:]).copy_(source.values[:, None])
            self.cumulative_length.copy_(source.cumulative_length)

    return PerDtypeStaticLayer
