"""Model folders given by relative paths work at every entry point: the Python API, the command line,
the converter and the app (an E2B-style checkpoint, whose per-layer table is mapped from its file)."""

import subprocess
import sys

import pytest

import gemma4_mlx
from app.backend import ModelHolder
from gemma4_mlx.testing import build_demo_checkpoint


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("relative")
    build_demo_checkpoint(folder / "demo")
    return folder


def run(workdir, *args):
    done = subprocess.run([sys.executable, "-m", *args], cwd=workdir, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done


@pytest.mark.parametrize("name", ["demo", "./demo", "demo/", "../PARENT/demo"])
def test_load(workdir, monkeypatch, name):
    monkeypatch.chdir(workdir)
    model, processor = gemma4_mlx.load(name.replace("PARENT", workdir.name))
    assert model.language_model.mapped_ple is not None  # the table is read from the file
    assert len(gemma4_mlx.generate(model, processor, "hello", max_tokens=3)) > 0


def test_command_line_and_converter(workdir):
    out = run(workdir, "gemma4_mlx", "--model", "./demo", "--prompt", "hello", "--max-tokens", "3")
    assert "tokens" in out.stderr  # the statistics line
    run(workdir, "convert", "--hf-path", "./demo", "--mlx-path", "demo-8bit", "-q", "--q-bits", "8")
    assert (workdir / "demo-8bit" / "config.json").exists()
    run(workdir, "gemma4_mlx", "--model", "demo-8bit", "--prompt", "hello", "--max-tokens", "3")


def test_app(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    holder = ModelHolder("./demo", None).start()
    assert holder.ready.wait(120)
    assert holder.engine is not None, holder.status
