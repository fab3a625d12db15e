"""Depth-aware execution helpers: per-row exit decisions and KV layouts for skipped loop steps.

A token that exits at loop step ``k`` of ``T`` has no K/V of its own for steps ``k+1 .. T-1``.
Two layouts say what later tokens read there (``kv_layout`` option of the models):

* ``"delayed"``: the token still runs the skipped steps, only to write their K/V; its output is
  read at step ``k``. Later tokens see exactly the full model's cache. Saves no compute.
* ``"last-exited"``: the token stops at ``k``; its step-``k`` K/V is copied into the slots of the
  later steps (Huginn's "latest" cache lookup). Saves the compute of the skipped steps; later
  tokens see a cache that differs from the full model's, so outputs may change.

Early exit applies to decode rows (one query token per sequence); prompt tokens run full depth.

A third layout, ``"shared"``, is not about exits: every loop step of a layer reads and writes one
K/V plane (the cache of a non-looped model; Huginn's vLLM plugin does this). Later steps overwrite
earlier ones, so past tokens keep only their last step's K/V. It needs ``1 / steps`` of the memory
and **changes the model's outputs**; it is off by default and must be used for a whole sequence.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

KV_LAYOUTS = ("delayed", "last-exited", "shared")


def check_kv_layout(kv_layout: str) -> None:
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout: must be one of {KV_LAYOUTS}, got {kv_layout!r}")


def per_row(value, n: int, dtype: torch.dtype, device, fill) -> torch.Tensor:
    """A per-row tensor from None (-> ``fill``), a scalar, or a tensor of ``n`` values."""
    if value is None:
        value = fill
    if isinstance(value, torch.Tensor):
        if value.numel() != n:
            raise ValueError(f"per-row option has {value.numel()} values for {n} rows")
        return value.to(device=device, dtype=dtype).reshape(n)
    return torch.full((n,), value, dtype=dtype, device=device)


def copy_kv_rows(src: torch.Tensor, dst: torch.Tensor, slots: torch.Tensor) -> None:
    """Copy the K/V entries at flat cache ``slots`` from plane ``src`` into plane ``dst``.

    Negative slots (padding rows) are skipped without reading them on the host, so on a GPU this
    is two gathers and the Triton KV-write kernel: safe inside CUDA-graph capture.
    """
    flat_src = src.view(2, -1, *src.shape[3:])
    rows = flat_src.index_select(1, slots.clamp(min=0))
    if src.is_cuda:
        from rlt_compile.kernels.triton_attention import kv_write_triton

        kv_write_triton(rows[0], rows[1], dst, slots)
    else:
        from rlt_compile.kernels.reference import kv_write_reference

        kv_write_reference(rows[0], rows[1], dst, slots)


def fill_skipped_kv(
    kv_caches: list[torch.Tensor],
    slot_of: Callable[[int, int], int],
    layers: int,
    exit_steps: int | torch.Tensor,
    total_steps: int,
    slot_mapping: torch.Tensor,
) -> None:
    """ "last-exited": for each row that exited at ``k``, copy step-``k`` K/V into steps ``k+1..``.

    ``slot_of(step, layer)`` is the model's KV slot index. Nothing is read back from the device, so
    this is CUDA-graph safe: with one exit step for the whole batch (an int) its plane is copied to
    each later one; with per-row steps (a tensor) step ``t`` takes step ``t-1``'s K/V for the rows
    that exited before ``t``, a chain that carries each row's exit-step K/V to the last step.
    """
    if isinstance(exit_steps, int):
        for t in range(exit_steps + 1, total_steps):
            for layer in range(layers):
                copy_kv_rows(kv_caches[slot_of(exit_steps, layer)], kv_caches[slot_of(t, layer)], slot_mapping)
        return
    for t in range(1, total_steps):
        slots = torch.where(exit_steps < t, slot_mapping, -1)
        for layer in range(layers):
            copy_kv_rows(kv_caches[slot_of(t - 1, layer)], kv_caches[slot_of(t, layer)], slots)


def fill_skipped_folded(
    layers: list[torch.Tensor],
    exits: list[tuple[list[int], int, int]],
    total_steps: int,
    block_size: int,
    blocks_per_step: int,
) -> None:
    """ "last-exited" on step-folded layer tensors (``[2, steps * blocks_per_step, block_size, Hkv, D]``,
    step ``t`` owning blocks ``t * blocks_per_step ..``): for each exiting row ``(block table,
    position, exit step k)`` copy step ``k``'s K/V at that position into steps ``k+1 .. total_steps-1``.
    One gather and one scatter per layer, however many rows exit (a copy per row, step and layer
    costs a launch each)."""
    plane = blocks_per_step * block_size
    src, dst = [], []
    for table, position, k in exits:
        slot = table[position // block_size] * block_size + position % block_size
        for t in range(k + 1, total_steps):
            src.append(k * plane + slot)
            dst.append(t * plane + slot)
    if not src:
        return
    device = layers[0].device
    src_t = torch.tensor(src, dtype=torch.long).to(device, non_blocking=True)
    dst_t = torch.tensor(dst, dtype=torch.long).to(device, non_blocking=True)
    for layer in layers:
        flat = layer.view(2, -1, *layer.shape[3:])
        flat.index_copy_(1, dst_t, flat.index_select(1, src_t))


def is_decode_only(input_ids: torch.Tensor, seq_lens: torch.Tensor) -> bool:
    """Shape-only test: one token per sequence."""
    return input_ids.shape[0] == seq_lens.shape[0]
