"""Shared helpers for the pattern tests (CPU, tiny shapes)."""
import pytest
import torch

import hstu_inductor  # noqa: F401  (registers the "hstu" backend and torch.ops.hstu.*)
import hstu_inductor.patterns.attention  # noqa: F401  (registers the attention rewriter)


@pytest.fixture
def fresh_dynamo():
    """Reset Dynamo's caches around a test (attention tests use it explicitly)."""
    torch._dynamo.reset()
    hstu_inductor.backend.register()  # reset() drops the Dynamo compile callbacks it installs
    yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _rab_tables_on(request):
    """The rab pattern tests check the table route (path b) in training and inference alike
    (``config.rab_tables`` defaults to "auto": tables in training only); tests of other values patch them."""
    with hstu_inductor.config.patch(rab_tables=True):
        yield
