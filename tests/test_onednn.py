"""oneDNN convolutions and max-pooling on XLA:CPU (xlafit.native.onednn).

The oneDNN path runs only in a process with one device, and the suite runs with 8, so the
numerical checks run in a process of their own (tests/onednn_one_device.py); the fallbacks
and errors are checked here."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from xlafit.native import onednn

from xlafit.models.resnet import ResNet


def test_one_device_checks():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    script = Path(__file__).with_name("onednn_one_device.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    # two checks more where this CPU runs oneDNN's bfloat16 natively
    assert done.stdout.count("ok ") == (7 if onednn.status().bfloat16 else 5), done.stdout


def test_several_devices_keep_xla_operations(strategy8):
    # A custom call does not split across a mesh: with 8 devices the model uses XLA's operations.
    model = ResNet(18, 10, width=8, rngs=nnx.Rngs(0))
    text = jax.jit(lambda images: model(images)).lower(jnp.zeros((8, 32, 32, 3))).as_text()
    assert "xlafit_onednn" not in text


def test_missing_compiler_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(onednn.BuildError, match="no C\\+\\+ compiler 'no-such-compiler' on PATH: install g\\+\\+"):
        onednn._build(tmp_path / "x.so")
    assert not list(tmp_path.iterdir())


def test_missing_wheel_is_named():
    with pytest.raises(onednn.BuildError, match=r"pip install 'xlafit\[onednn\]'"):
        onednn._wheel_file("no-such-wheel", "/libdnnl.so.3")


def test_turned_off_by_environment(monkeypatch):
    monkeypatch.setenv(onednn.ENV, "0")
    onednn.status.cache_clear()
    try:
        assert onednn.status() == onednn.Status(False, "turned off by XLAFIT_ONEDNN=0")
    finally:
        monkeypatch.delenv(onednn.ENV)
        onednn.status.cache_clear()


def test_resnet_conv_setting_is_checked():
    with pytest.raises(ValueError, match="conv='onednn': use 'auto'"):
        ResNet(18, 10, conv="onednn", rngs=nnx.Rngs(0))
