"""config.py and the root config: TOML + --section.field overrides, presets, --help, clear errors."""
import pytest

import config as config_lib
from config import ConfigError
from launch import DEBUG
from train_fsdp import Config, parse_config


def test_debug_toml_with_overrides_and_preset():
    cfg = parse_config(["--config", DEBUG, "--train.steps", "7", "--model.n_layers=3", "--run_dir", "/tmp/x"])
    assert cfg.train.steps == 7 and cfg.model.n_layers == 3 and cfg.run_dir == "/tmp/x"
    assert cfg.model.dim == 128  # from the debug preset
    assert cfg.train.dtype == "float32"


def test_resolved_config_round_trips(tmp_path):
    cfg = parse_config(["--config", DEBUG, "--optim.lr", "0.01"])
    path = tmp_path / "config.toml"
    config_lib.write_resolved(cfg, str(path))
    assert parse_config(["--config", str(path)]) == cfg


@pytest.mark.parametrize("argv, msg", [
    (["--train.stpes", "3"], "unknown config key 'train.stpes'; did you mean 'steps'"),
    (["--trian.steps", "3"], "did you mean 'train'"),
    (["--train.steps", "three"], "train.steps: expected int"),
    (["--model.preset", "gpt5"], "unknown preset 'gpt5'"),
    (["--model.n_heads", "5"], "model.dim (128) must be divisible by model.n_heads (5)"),
    (["--config", "/nonexistent.toml"], "cannot read '/nonexistent.toml'"),
    (["--train.steps"], "needs a value"),
])
def test_bad_input_names_the_key_and_the_fix(argv, msg):
    with pytest.raises(ConfigError) as e:
        parse_config(["--config", DEBUG, *argv] if argv[0] != "--config" else argv)
    assert msg in str(e.value)


def test_bad_toml_file_is_named(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        parse_config(["--config", str(bad)])


def test_help_lists_every_field_with_its_doc(capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for section in ("model", "data", "train", "optim", "parallel", "checkpoint"):
        cls = type(getattr(Config(), section))
        docs = config_lib.field_docs(cls)
        for name in cls.__dataclass_fields__:
            assert f"--{section}.{name} " in out
            assert docs.get(name), f"{section}.{name} has no doc"
