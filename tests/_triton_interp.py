"""Test infrastructure: the Triton interpreter without its re-patching on every helper call.

Under ``TRITON_INTERPRET=1`` each call of a ``@triton.jit`` helper function re-patches every builtin
of ``triton.language`` (``inspect.getmembers`` over ``tl``, ``tl.tensor``, ``tl.math``: about 0.2 ms),
although the kernel launch running it has patched them already. Our kernels call small helpers in
their inner loops (row views, tile order, masks), so that was about a fifth of the kernel tests'
time.

:func:`install` wraps the interpreter's private ``_patch_lang`` so that within one launch each set
of language modules is patched once (a helper from another module, e.g. ``tl.zeros`` in
``triton.language.standard`` seeing ``tl.core``, still gets its own patch). What is patched and when
it is restored is otherwise Triton's: the launch restores its patch at its end, helper patches are
left as Triton leaves them. A Triton without that hook is left alone (slower, same results);
``HSTU_TEST_PLAIN_INTERPRETER=1`` skips it.
"""
from __future__ import annotations

import inspect
import os


def install() -> bool:
    """Install the wrapper once; True when it is in place."""
    if os.environ.get("HSTU_TEST_PLAIN_INTERPRETER") == "1":
        return False
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    orig = getattr(interpreter, "_patch_lang", None)
    if getattr(orig, "_hstu_once_per_launch", False):
        return True
    if orig is None or not hasattr(interpreter, "_LangPatchScope"):
        return False
    launch = {"scope": None, "patched": frozenset()}

    def langs(fn) -> frozenset:
        # the modules Triton's _patch_lang patches for ``fn`` (the same test as its own)
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))

    def patch_lang(fn):
        key = langs(fn)
        if launch["scope"] is not None and key <= launch["patched"]:
            return interpreter._LangPatchScope()  # nothing new to patch; nothing to restore
        scope = orig(fn)
        if launch["scope"] is not None:  # a helper seeing other language modules
            launch["patched"] |= key
            return scope
        # The launch's own patch (GridExecutor restores it in a ``finally``): its end ends the launch.
        launch["scope"], launch["patched"] = scope, key
        restore = scope.restore

        def end_of_launch():
            launch["scope"], launch["patched"] = None, frozenset()
            restore()

        scope.restore = end_of_launch
        return scope

    patch_lang._hstu_once_per_launch = True
    interpreter._patch_lang = patch_lang
    return True
