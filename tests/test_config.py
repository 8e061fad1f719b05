"""cli.py and the root config: TOML + --section.field overrides, presets, --help, clear errors."""
import pytest

from config import Config, parse_config
from core import cli
from core.errors import ConfigError
from data_pipeline.loader import merge_ranges
from launch import DEBUG, prepared_data_dir, refused
from parallel import distributed
from training import command


def test_debug_toml_with_overrides_and_preset():
    cfg = parse_config(["--config", DEBUG, "--train.steps", "7", "--model.n_layers=3", "--run_dir", "/tmp/x"])
    assert cfg.train.steps == 7 and cfg.model.n_layers == 3 and cfg.run_dir == "/tmp/x"
    assert cfg.model.dim == 128  # from the debug preset
    assert cfg.train.dtype == "float32"


def test_resolved_config_round_trips(tmp_path):
    cfg = parse_config(["--config", DEBUG, "--optim.lr", "0.01"])
    path = tmp_path / "config.toml"
    cli.write_resolved(cfg, str(path))
    assert parse_config(["--config", str(path)]) == cfg


def test_resolved_config_round_trips_any_unicode_and_tables(tmp_path):
    """An emoji (outside the BMP: JSON's escapes of it are surrogates, which TOML refuses) and [[data.sources]]."""
    toml = tmp_path / "mix.toml"
    toml.write_text('[data]\n[[data.sources]]\nname = "a"\ndataset = "stdlib"\nweight = 2.0\n'
                    '[[data.sources]]\nname = "b"\ndataset = "stdlib"\nweight = 1.0\n')
    cfg = parse_config(["--config", str(toml), "--run_dir", str(tmp_path / "run \U0001F680"),
                        "--metrics.wandb_run_name", "caf\u00e9 \U0001F600"])
    path = tmp_path / "config.toml"
    cli.write_resolved(cfg, str(path))
    back = parse_config(["--config", str(path)])
    assert back == cfg and [s.name for s in back.data.sources] == ["a", "b"]
    assert back.metrics.wandb_run_name == "caf\u00e9 \U0001F600" and back.run_dir.endswith("\U0001F680")


@pytest.mark.parametrize("flag", ["--metrics.wandb_run_name", "--run_dir"])
def test_a_value_with_bytes_that_are_not_utf8_is_refused_when_parsed(flag):
    """A shell passes a latin-1 byte to argv as a lone surrogate; config.toml (UTF-8) could not hold it."""
    with pytest.raises(ConfigError, match=f"{flag[2:]}: .* holds a byte that is not UTF-8 .* give it as UTF-8 text"):
        parse_config(["--config", DEBUG, flag, "bad\udcffbyte"])


@pytest.mark.parametrize("argv, msg", [
    (["--train.stpes", "3"], "unknown config key 'train.stpes'; did you mean 'train.steps'"),
    (["--trian.steps", "3"], "did you mean 'train'"),
    (["--optim.lrr", "1e-3"], "unknown config key 'optim.lrr'; did you mean 'optim.lr'?"),
    (["--train.collective_timeout_s", "0.001"], "train.collective_timeout_s must be a number of seconds in [1, 1e7], "
                                                "got 0.001; the default is 300"),
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
        docs = cli.field_docs(cls)
        for name in cls.__dataclass_fields__:
            assert f"--{section}.{name} " in out or f"[[{section}.{name}]] tables" in out  # lists of tables: TOML only
            assert docs.get(name), f"{section}.{name} has no doc"


@pytest.mark.parametrize("argv, msg", [
    (["--train.steps", "99999999999999999999999"], "train.steps: 99999999999999999999999 is out of range"),
    (["--train.seed", "-99999999999999999999999"], "train.seed: -99999999999999999999999 is out of range"),
    (["--train.steps", "--model.n_layers", "3"], "--train.steps needs a value: --train.steps VALUE"),
    (["--model.preset", "banana"], "unknown preset 'banana'; valid: debug,"),
    (["--train.compile", "maybe"], "train.compile: expected bool, got 'maybe'"),
    (["--train.steps", "1" * 500], "train.steps: " + "1" * 20),
    (["--optim.lr", "x" * 500], "optim.lr: expected float, got 'xxx"),
])
def test_bad_override_values_are_config_errors(argv, msg):
    with pytest.raises(ConfigError) as e:
        parse_config(["--config", DEBUG, *argv])
    assert msg in str(e.value) and "\n" not in str(e.value) and len(str(e.value)) < 200, str(e.value)


@pytest.mark.parametrize("toml, msg", [
    (b"model = 5\n", "'model' is a section: set its fields as --model.FIELD value or in [model]"),
    (b"[[train]]\nsteps = 3\n", "'train' is a section"),
    (b"\xff\xfe", "is not UTF-8 text (byte 0); give a TOML file"),
    (b"[train\nsteps = 3\n", "is not valid TOML: Expected ']'"),
    (b"[train]\nsteps = [1, 2]\n", "train.steps: expected int, got [1, 2]"),
    (b"[train]\nsteps = true\n", "train.steps: expected int, got True"),
    (b"[train]\nsteps = {a = 1}\n", "train.steps: expected int, got {'a': 1}"),
    (b"[train]\ndtype = 5\n", "train.dtype: expected str, got 5"),
    (b"[train]\nsteps = 99999999999999999999999\n", "train.steps: 99999999999999999999999 is out of range"),
    (b"[optim]\nlr = 1" + b"0" * 400 + b"\n", "optim.lr: expected float, got 1000"),
    (b"[model]\npreset = 5\n", "model.preset: expected a preset name (str), got 5; valid: debug,"),
    (b"[model]\npreset = [\"debug\"]\n", "model.preset: expected a preset name (str), got ['debug']"),
    (b"run_dir = {a = 1}\n", "run_dir: expected str, got {'a': 1}"),
    (b"[[train.skip]]\nstart_step = 20\n",
     "train.skip[0]: no end_step given; every [[train.skip]] table needs start_step and end_step"),
])
def test_bad_toml_files_are_config_errors(tmp_path, toml, msg):
    path = tmp_path / "bad.toml"
    path.write_bytes(toml)
    with pytest.raises(ConfigError) as e:
        parse_config(["--config", str(path)])
    assert msg in str(e.value) and "\n" not in str(e.value) and len(str(e.value)) < 300, str(e.value)


def test_nested_and_overlapping_skip_tables_skip_their_union(tmp_path):
    """Rollback records pasted verbatim: a later, further-reaching skip contains an earlier one."""
    path = tmp_path / "skips.toml"
    path.write_text(open(DEBUG).read() + "".join(f"\n[[train.skip]]\nstart_step = {a}\nend_step = {b}\n"
                                                 for a, b in [(7, 10), (4, 12), (20, 21), (12, 14)]))
    cfg = parse_config(["--config", str(path)])
    assert merge_ranges(cfg.train.skip_ranges()) == [[4, 14], [20, 21]]


def test_unreadable_config_paths_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read .* Is a directory; give an existing TOML file"):
        parse_config(["--config", str(tmp_path)])
    with pytest.raises(ConfigError, match="embedded null byte"):
        parse_config(["--config", "a\0b.toml"])
    with pytest.raises(ConfigError, match="--config needs a value"):
        parse_config(["--config"])


@pytest.mark.parametrize("argv, msg", [
    (["--optim.lr", "inf"], "optim.lr must be a finite number, got inf"),
    (["--optim.eps", "inf"], "optim.eps must be a finite number, got inf"),
    (["--optim.min_lr_ratio", "2"], "optim.min_lr_ratio is a fraction of optim.lr: it must be in [0, 1], got 2.0"),
    (["--data.tokenizer_vocab_size", "10"], "data.tokenizer_vocab_size must be >= 259, got 10"),
    (["--data.tokenizer_train_chars", "0"], "data.tokenizer_train_chars must be > 0, got 0"),
    (["--data.dataset", ""], "data.dataset is empty"),
])
def test_values_no_run_can_use_are_refused_when_parsed(argv, msg):
    with pytest.raises(ConfigError) as e:
        parse_config(["--config", DEBUG, *argv])
    assert msg in str(e.value)


def test_an_error_message_stays_one_line_whatever_the_names_hold(capsys):
    from core.errors import UserError, report

    report(UserError("data.dataset: no file matches 'a\nb.jsonl'"))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "a\\nb.jsonl" in err


@pytest.mark.slow
def test_an_eot_id_that_the_prepared_run_directory_disagrees_with_is_refused_before_any_collective(
        tmp_path, capsys, monkeypatch):
    def no_collective(*args):
        raise AssertionError("the process group was started: a lone rank would wait for its peers")

    monkeypatch.setattr(distributed, "init_distributed", no_collective)
    prepared_data_dir(tmp_path)  # its tokenizer has [EOT] at id 2 (the debug corpus)
    argv = ["--config", DEBUG, "--run_dir", str(tmp_path), "--model.document_mask", "true", "--model.eot_id", "5"]
    line = refused(command.main, argv, capsys)
    assert "has [EOT] at id 2 but model.eot_id is 5; set --model.eot_id 2" in line, line
