"""Several processes on torch.distributed: tensor parallelism and KV transfer between ranks.

Tensor parallelism (``tensor_parallel(model)``, in place, after ``load_model``) splits every
attention's heads and KV heads and every MLP's hidden units across the ranks: q/k/v and gate/up
projections keep their rank's output rows (column parallel), o/down projections their input
columns and all-reduce the partial sums (row parallel), and ``lm_head`` keeps a vocabulary slice
whose logits are all-gathered. Norms, embeddings, Huginn's adapter and Ouro's exit gate are
replicated. Each rank then owns ``kv_heads / world`` heads of every KV plane, so the engine runs
unchanged on every rank (same schedule, same sampled tokens). Launch with ``torchrun``; the backend
is NCCL on NVIDIA, RCCL (also "nccl" in torch) on ROCm, gloo on the CPU.

Prefill/decode disaggregation: ``send_kv`` ships a request's KV blocks (every loop slot) to another
rank and ``recv_kv`` writes them into that rank's own blocks, so it can continue decoding.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from rlt_compile.models.base import LoopedLM
from rlt_compile.models.layers import Attention, FusedQKVAttention, FusedSwiGLU, SwiGLU


def init_distributed(backend: str | None = None) -> tuple[int, int]:
    """Join the process group torchrun describes (env://); returns (rank, world size)."""
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast (shared hosts)
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


class RowParallelLinear(nn.Module):
    """A linear layer holding a slice of the input features; partial outputs are all-reduced."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group=None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelHead(nn.Module):
    """``lm_head`` holding a slice of the vocabulary; the logits slices are all-gathered."""

    def __init__(self, weight: torch.Tensor, world: int, group=None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.world, self.group = world, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = F.linear(x, self.weight).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)


def _slice(t: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    if t.shape[dim] % world:
        raise ValueError(f"cannot split a dimension of {t.shape[dim]} across {world} ranks")
    return t.chunk(world, dim=dim)[rank].contiguous()


def _set(linear: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)


def _column(linear: nn.Linear, rank: int, world: int, groups: int = 1) -> None:
    """Keep this rank's output rows; with ``groups`` fused blocks (e.g. q|k|v) slice each block."""
    w = linear.weight.unflatten(0, (groups, -1))
    b = None if linear.bias is None else linear.bias.unflatten(0, (groups, -1))
    _set(
        linear, _slice(w, 1, rank, world).flatten(0, 1), None if b is None else _slice(b, 1, rank, world).flatten(0, 1)
    )


def _row(linear: nn.Linear, rank: int, world: int, group) -> RowParallelLinear:
    return RowParallelLinear(_slice(linear.weight, 1, rank, world), linear.bias, group)


def tensor_parallel(model: LoopedLM, rank: int | None = None, world: int | None = None, group=None) -> LoopedLM:
    """Shard ``model`` in place for this rank (defaults: the current process group)."""
    rank = dist.get_rank(group) if rank is None else rank
    world = dist.get_world_size(group) if world is None else world
    if world == 1:
        return model
    for module in list(model.modules()):
        if isinstance(module, Attention):
            if module.num_kv_heads % world:
                raise ValueError(f"{module.num_kv_heads} KV heads cannot be split across {world} ranks")
            for proj in (module.q_proj, module.k_proj, module.v_proj):
                _column(proj, rank, world)
            module.o_proj = _row(module.o_proj, rank, world, group)
            module.num_heads //= world
            module.num_kv_heads //= world
        elif isinstance(module, FusedQKVAttention):
            if module.num_heads % world:
                raise ValueError(f"{module.num_heads} heads cannot be split across {world} ranks")
            _column(module.Wqkv, rank, world, groups=3)
            if module.qk_bias is not None:
                module.qk_bias = nn.Parameter(_slice(module.qk_bias, 2, rank, world), requires_grad=False)
            module.proj = _row(module.proj, rank, world, group)
            module.num_heads //= world
        elif isinstance(module, SwiGLU):
            _column(module.gate_proj, rank, world)
            _column(module.up_proj, rank, world)
            module.down_proj = _row(module.down_proj, rank, world, group)
        elif isinstance(module, FusedSwiGLU):
            _column(module.fc, rank, world, groups=2)
            module.proj = _row(module.proj, rank, world, group)
    head = model.lm_head.weight
    if model.ties_embeddings:
        head = head.detach().clone()  # the embedding stays whole
    model.lm_head = VocabParallelHead(_slice(head, 0, rank, world), world, group)
    model.tie_weights = lambda: None  # the head is now a slice, no longer the embedding
    model.tp_size = world
    return model


def _blocks(kv_caches: list[torch.Tensor], block_ids: list[int]) -> torch.Tensor:
    index = torch.tensor(block_ids, device=kv_caches[0].device)
    return torch.stack([plane.index_select(1, index) for plane in kv_caches])


def send_kv(kv_caches: list[torch.Tensor], block_ids: list[int], dst: int, group=None) -> None:
    """Send the K/V of ``block_ids`` from every slot's plane to rank ``dst`` (one message)."""
    dist.send(_blocks(kv_caches, block_ids).contiguous(), dst=dst, group=group)


def recv_kv(kv_caches: list[torch.Tensor], block_ids: list[int], src: int, group=None) -> None:
    """Receive blocks sent by ``send_kv`` into this rank's ``block_ids`` (same count, any ids)."""
    buffer = torch.empty_like(_blocks(kv_caches, block_ids))
    dist.recv(buffer, src=src, group=group)
    index = torch.tensor(block_ids, device=kv_caches[0].device)
    for plane, received in zip(kv_caches, buffer):
        plane.index_copy_(1, index, received)
