"""The ops seam: every model module goes through gemma4_mlx.ops, a registered implementation is used
on its device (and only there), and GEMMA4_MLX_REFERENCE_OPS=1 forces the reference composition."""

import subprocess
import sys
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from gemma4_mlx import ops
from gemma4_mlx.ops import reference


@pytest.fixture
def registry(monkeypatch):
    """A clean registry for the test (restored after it)."""
    monkeypatch.setattr(ops, "_FAST", {})
    monkeypatch.setattr(ops, "_chosen", {})
    monkeypatch.setattr(ops, "REFERENCE_ONLY", False)
    return ops


def counting(calls: Counter):
    """Implementations that count their calls and compute the reference."""
    return {name: (lambda name: lambda *a: (calls.update([name]), getattr(reference, name)(*a))[1])(name) for name in ops.OPS}


def test_every_op_goes_through_the_seam(registry, family):
    calls = Counter()
    device = mx.default_device().type
    for name, fn in counting(calls).items():
        registry.register(name, device, fn)
    ids = mx.array(np.random.default_rng(0).integers(0, 1024, (1, 12)))
    got = family.model(ids)
    per_layer = family.model.text_config.num_hidden_layers
    assert calls["attention"] == per_layer and calls["add_rms_norm"] >= 2 * per_layer
    assert calls["rope"] >= per_layer and calls["geglu"] >= per_layer and calls["rms_norm"] >= 2 * per_layer
    if family.model.text_config.enable_moe_block:
        assert calls["moe_experts"] == per_layer
    # The reference and the (counting) registered path compute the same logits.
    registry.REFERENCE_ONLY = True
    registry._chosen.clear()
    calls.clear()
    assert mx.array_equal(family.model(ids), got).item() and not calls


def test_an_implementation_serves_only_its_device(registry):
    other = mx.DeviceType.gpu if mx.default_device().type == mx.DeviceType.cpu else mx.DeviceType.cpu
    registry.register("geglu", other, lambda gate, up: gate * 0)
    x = mx.ones((2, 3))
    assert mx.array_equal(registry.geglu(x, x), reference.geglu(x, x)).item()
    with pytest.raises(ValueError, match="no op named 'softmax'"):
        registry.register("softmax", other, lambda x: x)


def test_environment_variable_forces_the_reference():
    code = "import gemma4_mlx.ops as o; print(o.REFERENCE_ONLY)"
    for value, expected in (("1", "True"), ("0", "False"), ("", "False")):
        env = {"GEMMA4_MLX_REFERENCE_OPS": value, "PATH": ""}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert out.stdout.strip() == expected, out.stderr
