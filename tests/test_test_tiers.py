"""tests/conftest.py's ``HALVED`` names real test families: a renamed or removed family there would put all its
cases back into `make test` (or none of a new one's into the slow tier) without anyone noticing."""
from __future__ import annotations

import ast
import os

_CONFTEST = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conftest.py")


def _halved() -> tuple:
    with open(_CONFTEST, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "HALVED" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("tests/conftest.py defines no HALVED")


def test_every_halved_family_is_collected(request):
    """Checked against this session's items: families of the files it collected (all of them in `make test`)."""
    items = request.session.items
    files = {item.nodeid.split("::", 1)[0] for item in items}
    families = {item.nodeid.split("[", 1)[0] for item in items}
    halved = _halved()
    assert len(halved) == len(set(halved))
    stale = [f for f in halved if f.split("::", 1)[0] in files and f not in families]
    assert not stale, f"HALVED names families that no longer exist: {stale}"
