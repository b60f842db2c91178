"""The HTTP front end validates requests without torch: ingress, plan and strategy names stay torch-free."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_ingress_imports_without_torch_or_transformers():
    code = ("import sys, taps_ray.serving.ingress, taps_ray.serving.plan, taps_ray.spec.strategy; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
