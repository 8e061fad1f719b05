"""A missing optional package (pyproject.toml's extras) ends a command at start with one line
'error: ...' naming the extra that installs it, never a traceback or a refusal after the work."""
import os
import subprocess
import sys

import pytest

import train_fsdp
from core import errors
from launch import DEBUG

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def hidden(tmp_path, *modules: str) -> str:
    """A folder to put first on PYTHONPATH in which importing each module fails as if it were not installed."""
    shadow = tmp_path / "hidden"
    for m in modules:
        (shadow / m).mkdir(parents=True)
        (shadow / m / "__init__.py").write_text(f"raise ModuleNotFoundError(\"No module named '{m}'\", name='{m}')\n")
    return str(shadow)


def run_without(tmp_path, modules, *argv):
    """(exit status, stdout, stderr) of `python *argv` in the project root with modules hidden."""
    env = {**os.environ, "PYTHONPATH": hidden(tmp_path, *modules), "WORLD_SIZE": "1"}
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def the_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert "Traceback" not in stderr and len(lines) == 1 and lines[0].startswith("error: "), stderr[-2000:]
    return lines[0]


def test_require_returns_the_module_or_names_the_extra(monkeypatch):
    assert errors.require("json", "hf", "x") is sys.modules["json"]
    monkeypatch.setitem(sys.modules, "safetensors", None)  # importing it now raises ImportError
    with pytest.raises(errors.MissingPackageError) as e:
        errors.require("safetensors", "hf", "hf.py export")
    assert str(e.value) == ("hf.py export needs the Python package 'safetensors', which is not installed: "
                            "pip install -e \".[hf]\"")
    assert isinstance(e.value, errors.UserError)
    with pytest.raises(errors.MissingPackageError, match=r"'x\.zst' needs .*: pip install zstd_pkg; or decompress it$"):
        errors.require("zstd_pkg", None, "'x.zst'", "decompress it")


@pytest.mark.slow
def test_hf_export_without_safetensors_is_one_line_naming_the_hf_extra(tmp_path):
    # No run directory exists: the package is checked before anything is read.
    rc, out, err = run_without(tmp_path, ["safetensors"], "hf.py", "export", "--run_dir", str(tmp_path / "run"),
                               "--out", str(tmp_path / "out"))
    assert rc == 2, err[-2000:]
    assert the_error_line(err) == ("error: hf.py export needs the Python package 'safetensors', which is not "
                                   "installed: pip install -e \".[hf]\"")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_tensorboard_without_the_package_is_refused_before_the_corpus_is_tokenized(tmp_path):
    rd = tmp_path / "run"
    rc, out, err = run_without(tmp_path, ["tensorboard"], "train_fsdp.py", "--config", DEBUG, "--run_dir", str(rd),
                               "--metrics.tensorboard", "true")
    assert rc == 2, err[-2000:]
    assert the_error_line(err) == ("error: metrics.tensorboard = true needs the Python package 'tensorboard', which "
                                   "is not installed: pip install -e \".[tensorboard]\"; or set it to false")
    assert not (rd / "data").exists() and "[data]" not in out, out[-2000:]  # nothing prepared


def test_init_from_hf_without_safetensors_is_one_line_naming_the_hf_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setenv("WORLD_SIZE", "1")
    rc = train_fsdp.main(["--config", DEBUG, "--run_dir", str(tmp_path / "run"), "--init_from_hf", str(tmp_path)])
    assert rc == 2
    assert the_error_line(capsys.readouterr().err) == (
        "error: --init_from_hf needs the Python package 'safetensors', which is not installed: pip install -e \".[hf]\"")


def test_generate_from_an_hf_folder_without_safetensors_is_one_line_naming_the_hf_extra(tmp_path, monkeypatch,
                                                                                        capsys):
    import generate
    monkeypatch.setitem(sys.modules, "safetensors", None)
    assert generate.main(["--hf", str(tmp_path)]) == 2
    assert the_error_line(capsys.readouterr().err) == (
        "error: reading a Hugging Face folder needs the Python package 'safetensors', which is not installed: "
        "pip install -e \".[hf]\"")
