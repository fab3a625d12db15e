"""InputBuffers: a step's inputs written into static (pinned) host buffers and copied in one go.

Every step input the model reads - ``input_ids``, ``positions``, the attention metadata
(``slot_mapping``, ``block_tables``, ``seq_lens``, ``query_start_loc``), ``logits_indices`` - plus the
two index lists of the placeholder gather (``gather_dst``, ``gather_src``, see ``async_runner.py``)
lives in two packed buffers allocated once: one int64, one int32. A step writes its values into the
host buffers (numpy views of pinned memory; no tensor is built per field) at offsets computed for
that step, and the device sees contiguous views of the same offsets. Per step this is

* copy path (default): **two** ``non_blocking`` host-to-device copies (one per dtype) issued on a
  side stream (``copy_stream``); the compute stream waits for the copy's event before the step's
  kernels, so the copy never queues behind the previous step's kernels and the host never waits;
* UVA path (``uva=True``, from ``platform.uva_enabled()`` / ``RLT_UVA``): no copy at all; the device
  views *alias* the pinned host buffers (a CUDA tensor built through ``__cuda_array_interface__``
  on the pinned pointer, which under UVA is also the device pointer), so kernels read the metadata
  in place over the bus. It is only used after a self-test at construction (a torch kernel and,
  when Triton is installed, a Triton kernel read the aliased memory and must see the host's
  values); any failure logs the reason and falls back to the copy path.

Hazards. The buffers are double-buffered (``num_sets``, default 2): step ``k`` uses set ``k % 2``.
Before the host rewrites a set it waits for that set's last copy (copy path) or for the last step
that read it in place (UVA path, ``release``); before the side stream overwrites a set's device
buffers it waits (on the device) for the compute stream to be done with the set's previous step.
With the async engine the host has already read step ``k - 1``'s tokens when it writes step
``k + 1``, so these waits never block in practice.

On the CPU the "device" buffers are ordinary tensors and the copy is a memcpy; the layout code is
the same, which is what the CPU tests exercise.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

import numpy as np
import torch

from rlt_compile import envs
from rlt_compile.kernels.metadata import AttentionMetadata

log = logging.getLogger(__name__)

PLACEHOLDER = -1  # a token id the host does not know yet (taken from the device, see async_runner.py)


@dataclass
class StepTensors:
    """Device views of one staged step (valid until the set is reused two steps later)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn: AttentionMetadata
    logits_indices: torch.Tensor
    gather_dst: torch.Tensor  # flat token indices whose id comes from the device
    gather_src: torch.Tensor  # the row of the previous step's sampled ids for each of them
    set_index: int

    @property
    def num_gather(self) -> int:
        return self.gather_dst.shape[0]


@dataclass
class SeqChunk:
    """What one sequence contributes to a step (host values; placeholders marked ``PLACEHOLDER``)."""

    token_ids: list[int]  # the new tokens (len = query length)
    start: int  # position of the first one (= tokens already in the KV cache)
    block_table: list[int]
    sample: bool  # whether its last token produces a logits row
    gather_rows: dict[int, int] | None = None  # offset in token_ids -> source row (placeholders)


def _pinned(shape, dtype, pin: bool) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, pin_memory=pin)


class _CudaArray:
    """A ``__cuda_array_interface__`` over a pinned host buffer (the pointer is device-valid under UVA)."""

    def __init__(self, host: torch.Tensor):
        self.host = host  # the CUDA tensor's deleter holds this object, so the host memory outlives it
        typestr = {torch.int64: "<i8", torch.int32: "<i4"}[host.dtype]
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": typestr,
            "data": (host.data_ptr(), False),
            "version": 3,
            "strides": None,
        }


def uva_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor aliasing the pinned host tensor ``host`` (no copy). Raises when torch refuses."""
    if not host.is_pinned():
        raise ValueError("uva_view needs a pinned host tensor")
    with torch.cuda.device(device):
        view = torch.as_tensor(_CudaArray(host), device=device)
    if view.data_ptr() != host.data_ptr() or view.device.type != "cuda":
        raise RuntimeError("the CUDA view does not alias the host buffer")
    return view


_TRITON_COPY = None


def _triton_reads(view: torch.Tensor) -> torch.Tensor:
    """Copy ``view`` (1-D int64) with a Triton kernel: does Triton accept and read the pointer?"""
    global _TRITON_COPY
    import triton
    import triton.language as tl

    if _TRITON_COPY is None:

        @triton.jit
        def _copy(src, dst, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

        _TRITON_COPY = _copy
    out = torch.empty_like(view)
    n = view.numel()
    _TRITON_COPY[(triton.cdiv(n, 128),)](view, out, n, BLOCK=128)
    return out


def uva_self_test(device: torch.device) -> str | None:
    """None when kernels on ``device`` read pinned host memory through a UVA view correctly, else why not."""
    try:
        host = torch.arange(1000, 1256, dtype=torch.int64).pin_memory()
        view = uva_view(host, device)
        if not torch.equal((view + 0).cpu(), host):
            return "a torch kernel read wrong values through the UVA view"
        host.mul_(3)  # the host writes; the device must see it without a copy
        torch.cuda.synchronize(device)
        if not torch.equal((view + 0).cpu(), host):
            return "a host write was not visible through the UVA view"
        if importlib.util.find_spec("triton") is not None and not torch.equal(_triton_reads(view).cpu(), host):
            return "a Triton kernel read wrong values through the UVA view"
        torch.cuda.synchronize(device)
        return None
    except Exception as e:  # any failure means "copy path"
        return f"{type(e).__name__}: {e}"


class InputBuffers:
    def __init__(
        self,
        device: torch.device | str,
        max_tokens: int,
        max_seqs: int,
        max_blocks_per_seq: int,
        num_sets: int = 2,
        uva: bool | None = None,
    ):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.is_cuda = self.device.type == "cuda"
        self.num_sets = num_sets
        self.max_blocks_per_seq = max_blocks_per_seq
        if uva is None:
            from rlt_compile.platform import uva_enabled

            uva = self.is_cuda and uva_enabled()
        self.uva = False
        self.uva_reason = "not requested" if not uva else None
        if uva and not self.is_cuda:
            self.uva_reason = f"no UVA on {self.device}"
        elif uva:
            problem = uva_self_test(self.device)
            if problem is None:
                self.uva = True
                self.uva_reason = "self-test passed"
            else:
                self.uva_reason = problem
                log.warning("UVA in-place metadata disabled (%s); using pinned buffers + H2D copies", problem)
        side = self.is_cuda and not self.uva and envs.rlt_copy_stream()
        self.copy_stream = torch.cuda.Stream(self.device) if side else None  # None: copy on the compute stream
        self._copy_done = [None] * num_sets  # events: the set's last H2D copy finished
        self._released = [None] * num_sets  # events: the compute stream is done with the set's last step
        self.steps = 0
        self.copies = 0  # H2D copy calls issued
        self._allocate(3 * max_tokens + 3 * max_seqs, max_seqs * max(max_blocks_per_seq, 1) + 2 * max_seqs + 1)

    # -- allocation ------------------------------------------------------------------------------
    def _allocate(self, cap64: int, cap32: int) -> None:
        self.cap64, self.cap32 = cap64, cap32
        pin = self.is_cuda
        self.host64 = [_pinned(cap64, torch.int64, pin) for _ in range(self.num_sets)]
        self.host32 = [_pinned(cap32, torch.int32, pin) for _ in range(self.num_sets)]
        self.np64 = [t.numpy() for t in self.host64]
        self.np32 = [t.numpy() for t in self.host32]
        if self.uva:
            self.dev64 = [uva_view(t, self.device) for t in self.host64]
            self.dev32 = [uva_view(t, self.device) for t in self.host32]
        else:
            self.dev64 = [torch.zeros(cap64, dtype=torch.int64, device=self.device) for _ in range(self.num_sets)]
            self.dev32 = [torch.zeros(cap32, dtype=torch.int32, device=self.device) for _ in range(self.num_sets)]

    def _ensure(self, need64: int, need32: int) -> None:
        if need64 <= self.cap64 and need32 <= self.cap32:
            return
        if self.is_cuda:
            torch.cuda.synchronize(self.device)  # rare (a prefill over the budget): no set is in use after this
        log.info("input buffers grown to %d int64 / %d int32 values", max(need64, self.cap64), max(need32, self.cap32))
        self._allocate(max(need64, 2 * self.cap64), max(need32, 2 * self.cap32))

    # -- one step --------------------------------------------------------------------------------
    def stage(self, chunks: list[SeqChunk], block_size: int) -> StepTensors:
        """Write the step's inputs into the next buffer set and make them visible to the device."""
        T = sum(len(c.token_ids) for c in chunks)
        S = len(chunks)
        R = sum(1 for c in chunks if c.sample)
        G = sum(len(c.gather_rows or ()) for c in chunks)
        W = max([len(c.block_table) for c in chunks] + [1])
        n64, n32 = 3 * T + R + 2 * G, S * W + 2 * S + 1
        self._ensure(n64, n32)
        k = self.steps % self.num_sets
        self.steps += 1
        self._wait_host_free(k)
        a64, a32 = self.np64[k], self.np32[k]
        o_pos, o_slot, o_logit = T, 2 * T, 3 * T
        o_gdst = o_logit + R
        o_gsrc = o_gdst + G
        o_len, o_qsl = S * W, S * W + S
        tables = a32[: S * W].reshape(S, W)
        tables[:] = 0
        t = r = g = 0
        for i, c in enumerate(chunks):
            n, start, table = len(c.token_ids), c.start, c.block_table
            if n == 1:  # decode: scalar arithmetic is cheaper than numpy per sequence
                a64[t] = c.token_ids[0] if c.token_ids[0] != PLACEHOLDER else 0
                a64[o_pos + t] = start
                a64[o_slot + t] = table[start // block_size] * block_size + start % block_size
            else:
                ids = np.asarray(c.token_ids, dtype=np.int64)
                a64[t : t + n] = np.where(ids == PLACEHOLDER, 0, ids)
                pos = np.arange(start, start + n, dtype=np.int64)
                a64[o_pos + t : o_pos + t + n] = pos
                a64[o_slot + t : o_slot + t + n] = np.asarray(table, dtype=np.int64)[pos // block_size] * block_size + (
                    pos % block_size
                )
            if c.gather_rows:
                for offset, row in c.gather_rows.items():
                    a64[o_gdst + g] = t + offset
                    a64[o_gsrc + g] = row
                    g += 1
            tables[i, : len(table)] = table
            a32[o_len + i] = start + n
            a32[o_qsl + i] = t
            t += n
            if c.sample:
                a64[o_logit + r] = t - 1
                r += 1
        a32[o_qsl + S] = T
        self._publish(k, n64, n32)
        d64, d32 = self.dev64[k], self.dev32[k]
        attn = AttentionMetadata(
            slot_mapping=d64[o_slot : o_slot + T],
            block_tables=d32[: S * W].view(S, W),
            seq_lens=d32[o_len : o_len + S],
            query_start_loc=d32[o_qsl : o_qsl + S + 1],
        )
        return StepTensors(
            input_ids=d64[:T],
            positions=d64[o_pos : o_pos + T],
            attn=attn,
            logits_indices=d64[o_logit : o_logit + R],
            gather_dst=d64[o_gdst : o_gdst + G],
            gather_src=d64[o_gsrc : o_gsrc + G],
            set_index=k,
        )

    def _wait_host_free(self, k: int) -> None:
        """Block until nothing still reads host set ``k`` (its copy, or in-place readers under UVA)."""
        event = self._released[k] if self.uva else self._copy_done[k]
        if event is not None:
            event.synchronize()

    def _publish(self, k: int, n64: int, n32: int) -> None:
        if self.uva:
            return  # the device reads the host buffers in place
        if not self.is_cuda:
            self.dev64[k][:n64].copy_(self.host64[k][:n64])
            self.dev32[k][:n32].copy_(self.host32[k][:n32])
            self.copies += 2
            return
        compute = torch.cuda.current_stream(self.device)
        stream = self.copy_stream or compute
        if self._released[k] is not None and stream is not compute:
            stream.wait_event(self._released[k])  # the device buffers' previous step has run
        with torch.cuda.stream(stream):
            self.dev64[k][:n64].copy_(self.host64[k][:n64], non_blocking=True)
            self.dev32[k][:n32].copy_(self.host32[k][:n32], non_blocking=True)
            done = self._copy_done[k] or torch.cuda.Event()
            done.record(stream)
        self._copy_done[k] = done
        self.copies += 2
        compute.wait_event(done)

    def release(self, tensors: StepTensors) -> None:
        """Call after the step's kernels that read ``tensors`` are queued on the compute stream."""
        if not self.is_cuda:
            return
        k = tensors.set_index
        event = self._released[k] or torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._released[k] = event
