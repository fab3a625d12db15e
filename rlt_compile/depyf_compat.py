"""depyf on torch 2.13: a shim for ``PyCodeCache.load_by_key_path``'s new ``set_sys_modules`` keyword.

``depyf.prepare_debug`` replaces ``torch._inductor.codecache.PyCodeCache.load_by_key_path`` with a
function of the old signature ``(key, path, linemap=None, attrs=None)``. torch 2.13 calls it with a
keyword ``set_sys_modules=...`` as soon as Inductor loads generated code, which raises TypeError
inside depyf (torch 2.11 does not pass it). ``install()`` swaps depyf's replacement for a wrapper
that accepts any keyword arguments and forwards them to torch's own function; it is a no-op when
torch does not have the keyword or depyf already accepts it. ``depyf_dump(dir)`` installs the shim
and enters ``depyf.prepare_debug(dir)``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from pathlib import Path

_installed = False


def _torch_takes_keywords() -> bool:
    from torch._inductor.codecache import PyCodeCache

    params = inspect.signature(PyCodeCache.load_by_key_path).parameters
    return any(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values())


def needs_shim() -> bool:
    """True when torch passes keyword arguments that depyf's replacement does not accept."""
    try:
        from depyf.explain import patched_load_by_key_path as mod
    except ImportError:
        return False
    params = inspect.signature(mod.patched_load_by_key_path).parameters
    depyf_ok = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    return _torch_takes_keywords() and not depyf_ok


def install() -> bool:
    """Install the shim if needed; returns whether it is (now) installed."""
    global _installed
    if _installed:
        return True
    if not needs_shim():
        return False
    from depyf.explain import enable_debugging, global_variables
    from depyf.explain import patched_load_by_key_path as mod

    original = mod.patched_load_by_key_path

    def load_by_key_path(key, path, linemap=None, attrs=None, **kwargs):
        data = global_variables.data
        torch_fn = data["unpatched_load_by_key_path"]
        if kwargs:  # depyf calls torch_fn(key, path, linemap, attrs): bind the keywords for this call
            data["unpatched_load_by_key_path"] = functools.partial(torch_fn, **kwargs)
        try:
            return original(key, path, linemap, attrs)
        finally:
            data["unpatched_load_by_key_path"] = torch_fn

    load_by_key_path.__name__ = original.__name__
    enable_debugging.patched_load_by_key_path = load_by_key_path  # the name prepare_debug installs
    _installed = True
    return True


@contextlib.contextmanager
def depyf_dump(dump_dir: str | Path):
    """``depyf.prepare_debug(dump_dir)`` with the torch 2.13 shim installed."""
    import depyf

    install()
    dump_dir = Path(dump_dir)
    dump_dir.mkdir(parents=True, exist_ok=True)
    with depyf.prepare_debug(str(dump_dir)):
        yield dump_dir
