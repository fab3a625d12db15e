"""PassManager: runs our FX passes, in order, over the graph Dynamo captured for one compile unit.

A pass is an object with a ``name`` and a ``run(gm, ctx) -> str | None`` method that rewrites
``gm.graph`` in place and returns a one-line summary of what it changed (None or "" = nothing).
The manager lints and recompiles the graph after each pass that changed something, logs every
summary on the ``rlt_compile.passes`` logger ("attention_swap: 8 nodes rlt.attention ->
rlt.attention_triton") and keeps them in ``history`` so tests, ``inspect`` and the dump files
can show exactly what each pass did.

``format_graph`` prints a graph compactly (one line per node, parameter names shortened) for
snapshots and dump files.
"""

from __future__ import annotations

import logging
import operator
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import fx

from rlt_compile.platform import Platform

log = logging.getLogger("rlt_compile.passes")


@dataclass
class PassContext:
    """What a pass may consult: the target platform, the requested attention backend (None =
    the platform's choice), the name of the compile unit being compiled and, inside the
    torch.compile backend, the real tensors Dynamo passes for the graph's inputs."""

    platform: Platform
    attention_backend: str | None = None
    unit: str = "?"
    example_inputs: list | None = None

    def placeholder_values(self, gm: fx.GraphModule) -> dict[fx.Node, Any] | None:
        """Placeholder node -> the real value of that input (None when unknown)."""
        if self.example_inputs is None:
            return None
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(self.example_inputs):
            return None
        return dict(zip(placeholders, self.example_inputs))


class GraphPass(Protocol):
    name: str

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> str | None: ...


@dataclass
class PassRecord:
    unit: str
    pass_name: str
    message: str

    def __str__(self) -> str:
        return f"[{self.unit}] {self.pass_name}: {self.message}"


@dataclass
class PassManager:
    """An ordered list of passes. ``run(gm, ctx)`` applies them and returns this run's records."""

    passes: Sequence[GraphPass]
    history: list[PassRecord] = field(default_factory=list)

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.passes]

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> list[PassRecord]:
        records = []
        for p in self.passes:
            message = p.run(gm, ctx)
            if not message:
                log.debug("[%s] %s: no change", ctx.unit, p.name)
                continue
            gm.graph.lint()
            gm.recompile()
            record = PassRecord(ctx.unit, p.name, message)
            log.info("%s", record)
            records.append(record)
        self.history.extend(records)
        return records


# ------------------------------------------------------------------------------------ registry
def pass_registry() -> dict[str, type]:
    from rlt_compile.passes.attention_swap import AttentionSwapPass
    from rlt_compile.passes.dot_precision import DotPrecisionPass
    from rlt_compile.passes.fuse_linears import FuseLinearsPass
    from rlt_compile.passes.fuse_rmsnorm import FuseRMSNormPass
    from rlt_compile.passes.fuse_rope_gemv import FuseRopeGemvPass
    from rlt_compile.passes.fuse_swiglu_gemv import FuseSwiGLUGemvPass
    from rlt_compile.passes.gemv_swap import GemvSwapPass, GemvSwapSwiGLUPass

    return {
        "attention_swap": AttentionSwapPass,
        "dot_precision": DotPrecisionPass,
        "fuse_linears": FuseLinearsPass,
        "fuse_rmsnorm": FuseRMSNormPass,
        "fuse_rope_gemv": FuseRopeGemvPass,
        "fuse_swiglu_gemv": FuseSwiGLUGemvPass,
        "gemv_swap": GemvSwapPass,
        "gemv_swap_swiglu": GemvSwapSwiGLUPass,
    }


DEFAULT_PASSES: tuple[str, ...] = (
    "attention_swap",
    "dot_precision",
    "fuse_linears",
    "fuse_rmsnorm",
    "gemv_swap",
    "fuse_rope_gemv",
    "fuse_swiglu_gemv",
)


def build_passes(spec: Iterable[str | GraphPass] | None = None) -> list[GraphPass]:
    """Pass objects from a list of names and/or pass objects (None = ``DEFAULT_PASSES``)."""
    registry = pass_registry()
    out: list[GraphPass] = []
    for item in DEFAULT_PASSES if spec is None else spec:
        if isinstance(item, str):
            if item not in registry:
                raise ValueError(f"unknown pass {item!r}; known passes: {', '.join(registry)}")
            out.append(registry[item]())
        elif hasattr(item, "run") and hasattr(item, "name"):
            out.append(item)
        else:
            raise TypeError(f"a pass must be a name or an object with .name and .run(gm, ctx), got {item!r}")
    return out


# ------------------------------------------------------------------------------------ helpers
def is_op(node: fx.Node, op) -> bool:
    """Whether ``node`` calls ``op`` (an OpOverloadPacket matches its overloads and vice versa)."""
    if node.op != "call_function":
        return False
    target = node.target
    if target is op:
        return True
    packet = op if isinstance(op, torch._ops.OpOverloadPacket) else getattr(op, "overloadpacket", None)
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket is packet
    return isinstance(target, torch._ops.OpOverloadPacket) and target is packet


def op_name(target) -> str:
    """``rlt.attention_triton`` for ``torch.ops.rlt.attention_triton.default`` (and its packet)."""
    if isinstance(target, torch._ops.OpOverload):
        packet = target.overloadpacket
        return f"{packet._qualified_op_name.replace('::', '.')}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.replace("::", ".")
    return _callable_name(target)


def node_value(node: Any):
    """The example value (a FakeTensor) Dynamo/AOT recorded for ``node``, if any."""
    if not isinstance(node, fx.Node):
        return None
    return node.meta.get("example_value", node.meta.get("val"))


def full_args(node: fx.Node, schema) -> list:
    """Positional arguments of ``node`` completed from its kwargs and the schema's defaults."""
    args = list(node.args)
    for arg in schema.arguments[len(args) :]:
        if arg.name in node.kwargs:
            args.append(node.kwargs[arg.name])
        elif arg.has_default_value():
            args.append(arg.default_value)
        else:
            raise ValueError(f"{node.format_node()}: missing argument {arg.name!r}")
    return args


# ------------------------------------------------------------------------------------ printing
_PARAM_PREFIX = re.compile(r"^(l_|L_)(self_)?")


def short_name(name: str) -> str:
    """``l_self_modules_model_modules_layers_modules_0_modules_mlp_modules_up_proj_parameters_weight_``
    -> ``model.layers.0.mlp.up_proj.weight``; ``l_kv_caches_0_`` -> ``kv_caches.0``."""
    out = _PARAM_PREFIX.sub("", name)
    out = re.sub(r"_(modules|parameters|buffers)_", ".", out)
    out = re.sub(r"^(modules|parameters|buffers)_", "", out)
    out = out.rstrip("_")
    out = re.sub(r"_(\d+)(?=_|$)", r".\1", out) if out.startswith(("kv_caches", "args")) else out
    return out


def _callable_name(target) -> str:
    if isinstance(target, str):
        return f".{target}"
    if target in _OPERATOR_NAMES:
        return _OPERATOR_NAMES[target]
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", repr(target))
    if module.startswith("torch._C._nn"):
        module = "torch.nn.functional"
    elif module.startswith("torch._C._VariableFunctions") or module == "torch._C":
        module = "torch"
    elif module.startswith("torch.nn.functional"):
        module = "torch.nn.functional"
    name = name.removeprefix("_VariableFunctionsClass.")
    return f"{module}.{name}" if module and module != "builtins" else name


_OPERATOR_NAMES = {
    operator.getitem: "getitem",
    operator.add: "add",
    operator.sub: "sub",
    operator.mul: "mul",
    operator.truediv: "truediv",
    operator.neg: "neg",
    operator.pow: "pow",
    operator.floordiv: "floordiv",
    operator.mod: "mod",
}


def _fmt_arg(a, names: dict[fx.Node, str]) -> str:
    if isinstance(a, fx.Node):
        return names[a]
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_fmt_arg(x, names) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
    if isinstance(a, dict):
        return "{" + ", ".join(f"{k}: {_fmt_arg(v, names)}" for k, v in a.items()) + "}"
    if isinstance(a, float):
        return f"{a:.6g}"
    if isinstance(a, torch.dtype):
        return str(a)
    return repr(a)


def _shape(node: fx.Node) -> str:
    val = node_value(node)
    if isinstance(val, torch.Tensor):
        dims = ", ".join(str(d) for d in val.shape)
        return f"  # {str(val.dtype).replace('torch.', '')}[{dims}]"
    return ""


def _is_assert(node: fx.Node) -> bool:
    return node.op == "call_function" and "assert_scalar" in str(node.target)


def format_graph(gm: fx.GraphModule, shapes: bool = False, asserts: bool = True) -> str:
    """One line per node: ``name = target(args)``; inputs shortened (see ``short_name``).

    ``shapes`` appends dtype and shape; ``asserts=False`` leaves out the runtime size assertions
    (and the symbolic-size inputs and comparisons that only feed them)."""
    names: dict[fx.Node, str] = {}
    lines = []
    hidden: set[fx.Node] = set()
    if not asserts:
        for node in reversed(gm.graph.nodes):
            if (
                _is_assert(node)
                or (node.users and all(u in hidden for u in node.users))
                or node.op == "placeholder"
                and not isinstance(node_value(node), torch.Tensor)
                and not node.users
            ):
                hidden.add(node)
    taken = {n.name for n in gm.graph.nodes if n.op != "placeholder"}
    for node in gm.graph.nodes:
        if node in hidden:
            continue
        if node.op == "placeholder":
            name = short_name(node.name)
            while name in taken:  # an input shortened to the name of a node (e.g. "s")
                name += "_in"
            taken.add(name)
            names[node] = name
            lines.append(f"input {names[node]}{_shape(node) if shapes else ''}")
            continue
        names[node] = node.name
        if node.op == "output":
            lines.append(f"return {_fmt_arg(node.args[0], names)}")
            continue
        if node.op == "get_attr":
            lines.append(f"{node.name} = getattr({node.target!r})")
            continue
        args = [_fmt_arg(a, names) for a in node.args]
        args += [f"{k}={_fmt_arg(v, names)}" for k, v in node.kwargs.items()]
        if node.op == "call_method":  # self.method(rest)
            target = f"{args.pop(0)}.{node.target}"
        elif node.op == "call_module":
            target = f"module:{node.target}"
        elif isinstance(node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            target = op_name(node.target)
        else:
            target = _callable_name(node.target)
        lines.append(f"{node.name} = {target}({', '.join(args)}){_shape(node) if shapes else ''}")
    return "\n".join(lines) + "\n"
