"""Interpreted launches (``rlt_compile.kernels.launch.interpreter_scope``) on the CPU: correct results,
``triton.language`` patched once per launch and module rather than at every device-function call,
NumPy dtypes looked up in a table, and Triton left exactly as it was afterwards (later real compiles in
the process depend on it)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

from rlt_compile.kernels import launch
from rlt_compile.kernels.launch import interpreter_scope, kernel_for

LANGUAGE = (tl, tl.core, tl.math, tl.core.tensor)


@triton.jit
def _scaled(x, s):
    return x * s


def _helper_loop_kernel(x_ptr, out_ptr, N: tl.constexpr, STEPS: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + tl.program_id(0) * N + offs)
    acc = tl.zeros([N], tl.float32)
    for i in range(STEPS):  # a device-function call per step, and tl.sum (triton.language.standard)
        acc += _scaled(x, i + 1)
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


def _launch(x: torch.Tensor, steps: int) -> torch.Tensor:
    rows, n = x.shape
    out = torch.empty(rows)
    with interpreter_scope(True):
        kernel_for(_helper_loop_kernel, True)[(rows,)](x, out, N=n, STEPS=steps)
    return out


def _expected(x: torch.Tensor, steps: int) -> torch.Tensor:
    return x.sum(-1) * sum(range(1, steps + 1))


def _language_state() -> list[dict]:
    """What each name resolves to (Triton's own restore turns some inherited tensor methods into
    equal own attributes; that is not a change)."""
    skip = {"__dict__", "__annotations__"}
    return [{k: getattr(module, k) for k in dir(module) if k not in skip} for module in LANGUAGE]


def _same(a, b) -> bool:
    return a is b or (callable(a) and a == b)  # bound class methods are new objects at each access


def test_interpreted_launch_is_correct_and_restores_triton_language():
    before = _language_state()
    own_patch = interpreter._patch_lang
    x = torch.randn(3, 16)
    torch.testing.assert_close(_launch(x, 5), _expected(x, 5))
    assert interpreter._patch_lang is own_patch
    after = _language_state()
    for module, old, new in zip(LANGUAGE, before, after, strict=True):
        changed = sorted(k for k in old.keys() | new.keys() if not _same(old.get(k), new.get(k)))
        assert not changed, (module, changed)


def test_language_is_patched_once_per_module_and_launch(monkeypatch):
    calls = []
    real = interpreter._patch_lang

    def counting(fn):
        calls.append(fn.__name__)
        return real(fn)

    monkeypatch.setattr(interpreter, "_patch_lang", counting)
    x = torch.randn(2, 16)
    for steps in (1, 12):
        calls.clear()
        torch.testing.assert_close(_launch(x, steps), _expected(x, steps))
        # the kernel's (its module sees triton.language), then the first call into triton.language.core's
        # own functions (tl.zeros); none for the helper's calls nor for tl.sum's
        assert calls == ["_helper_loop_kernel", "zeros"], calls
    assert interpreter._patch_lang is counting


def test_np_dtypes_come_from_a_table_during_a_launch_and_equal_triton_s(monkeypatch):
    real = interpreter._get_np_dtype
    asked = []

    def counting(tt_dtype):
        asked.append(tt_dtype)
        return real(tt_dtype)

    monkeypatch.setattr(interpreter, "_get_np_dtype", counting)
    x = torch.randn(2, 16)
    torch.testing.assert_close(_launch(x, 12), _expected(x, 12))
    # each element type is mapped once per launch (the uncached interpreter asks at nearly every op:
    # 34 times for 2 types here), pointers every time
    element_types = [t for t in asked if not isinstance(t, tl.pointer_type)]
    assert 0 < len(element_types) == len(set(map(str, element_types))) <= 4, element_types
    assert interpreter._get_np_dtype is counting

    cached = launch._np_dtype_cached(real)
    for tt_dtype in (
        tl.float32,
        tl.bfloat16,
        tl.int1,
        tl.int64,
        tl.pointer_type(tl.float16),
        tl.block_type(tl.float16, [4]),
        tl.block_type(tl.pointer_type(tl.int32), [2, 8]),
    ):
        assert cached(tt_dtype) == cached(tt_dtype) == real(tt_dtype), tt_dtype
