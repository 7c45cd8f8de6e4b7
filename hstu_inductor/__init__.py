"""hstu-inductor: a torch.compile backend that rewrites HSTU subgraphs to Triton kernels.

    model = torch.compile(model, backend="hstu")   # no import needed once installed
    print(hstu_inductor.explain(model, *inputs))    # what was rewritten, and why not
"""
from . import _compat, config, ops  # noqa: F401  (ops: registers torch.ops.hstu.*)
from .backend import hstu_backend, register as _register
from .explain import explain
from .report import RewriteReport

__version__ = "0.1.0"
__all__ = ["config", "explain", "hstu_backend", "RewriteReport", "__version__"]

_register()
# torch._logging.set_logs(modules={"hstu": logging.INFO}); a name torch already owns is left alone
_compat.register_torch_log("hstu", "hstu_inductor")
