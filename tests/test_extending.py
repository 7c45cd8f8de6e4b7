"""docs/extending.md's change list for a mask option holds: scripts/check_extending.py applies the example option
(docs/extending_sink_rows.patch, four files) to a copy of the package and checks the reference, the kernels, the op
and a rewritten model against the option's definition."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.heavy
def test_mask_option_change_list_holds():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "check_extending.py")], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "patch touches 4 files" in out.stdout and "the change list holds" in out.stdout
    assert "sink_rows=3" in out.stdout  # the rewritten model's attention carries the new option
