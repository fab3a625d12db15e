"""The attention custom ops: the one generic op models call, and the concrete backends.

``torch.ops.rlt.attention`` is what every model's attention calls (design contract 1). Its eager
implementation is the plain-torch reference, so models run anywhere. Under ``compile_model`` the
attention-swap pass rewrites each call to the backend the Platform picks (``ATTENTION_BACKENDS``).
All ops share one signature, write the step's K/V into ``kv_cache`` and return the attention
output; their fake implementations let Dynamo and Inductor treat each call as a single node.
"""

from __future__ import annotations

import torch

from rlt_compile.kernels.reference import attention_reference

# The generic op models call (eager: the torch reference) and the torch backend the swap pass can
# select: the same implementation under two names, so the swap is visible in the graph.
attention = torch.library.custom_op("rlt::attention", attention_reference, mutates_args=("kv_cache",))
attention_torch = torch.library.custom_op("rlt::attention_torch", attention_reference, mutates_args=("kv_cache",))


def _fake(q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale):
    return torch.empty_like(q)


attention.register_fake(_fake)
attention_torch.register_fake(_fake)
