"""generate.py, evaluate.py and hf.py refuse bad input with one line 'error: ...' naming the flag
or file and the fix, exit status 2 and no traceback, and overwrite nothing that exists."""
import os
import shutil
import subprocess
import sys

import pytest

import evaluate
import generate
import hf
import plot
from data_pipeline import tokenizer
from debug_export import debug_run_dir
from launch import DEBUG, ROOT, refused
from model import ModelArgs
from models import random_model

TINY = dict(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, vocab_size=320, ffn_dim=64, max_seq_len=32)


def _tree(folder) -> dict:
    """{relative path: bytes} of every file under folder, to prove a refusal left it as it was."""
    out = {}
    for d, _, files in os.walk(folder):
        for f in files:
            path = os.path.join(d, f)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, folder)] = fh.read()
    return out


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> str:
    """A tiny Hugging Face Llama folder (random weights, a small trained tokenizer)."""
    root = tmp_path_factory.mktemp("cli_hf")
    tok = str(root / "tokenizer.json")
    tokenizer.train_tokenizer([open(os.path.join(ROOT, "model.py")).read()], 320, 50_000).save(tok)
    args = ModelArgs(**TINY)
    hf.save_hf(random_model(args).state_dict(), args, tok, str(root / "hf"))
    return str(root / "hf")


@pytest.mark.parametrize("argv, words", [
    (["--max_new_tokens", "0"], ["--max_new_tokens", "'0'", "int >= 1"]),
    (["--max_new_tokens", "-5"], ["--max_new_tokens", "'-5'"]),
    (["--temperature", "nan"], ["--temperature", "'nan'", "finite number >= 0"]),
    (["--temperature", "-1"], ["--temperature", "'-1'"]),
    (["--top_p", "0"], ["--top_p", "(0, 1]"]),
    (["--top_p", "1.5"], ["--top_p", "'1.5'"]),
    (["--top_k", "-1"], ["--top_k", "'-1'", "int >= 0"]),
    (["--num_samples", "0"], ["--num_samples", "'0'"]),
    (["--seed", "99999999999999999999999"], ["--seed", "64-bit"]),
    (["--device", "banana"], ["--device", "'banana'", "use cpu, cuda"]),
    (["--device", "cuda:99"], ["--device", "'cuda:99'", "CUDA device"]),
    (["--device", "meta"], ["--device", "'meta'"]),
    (["--checkpoint", "x", "--hf", "y"], ["--checkpoint", "--run_dir", "--hf"]),
])
def test_generate_refuses_bad_flags_before_loading(tmp_path, capsys, argv, words):
    src = [] if "--hf" in argv else ["--run_dir", str(tmp_path / "never_read")]
    line = refused(generate.main, [*src, *argv], capsys)
    assert all(w in line for w in words), line


def test_generate_names_a_missing_run_or_folder(tmp_path, capsys):
    assert "has no config.toml" in refused(generate.main, ["--run_dir", str(tmp_path / "nope")], capsys)
    assert "is not a directory" in refused(generate.main, ["--hf", str(tmp_path / "nope")], capsys)


@pytest.mark.parametrize("content, words", [
    (b"", "header too small"),
    (b"\xff" * 100, "header too large"),
    (None, "not fully covered"),  # the real file cut short
], ids=["empty", "garbage", "truncated"])
def test_a_corrupt_safetensors_file_is_named(tmp_path, capsys, hf_folder, content, words):
    bad = tmp_path / "hf"
    shutil.copytree(hf_folder, bad)
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:2000] if content is None else content)
    line = refused(generate.main, ["--hf", str(bad), "--max_new_tokens", "2"], capsys)
    assert f"cannot read weights '{weights}'" in line and words in line and "again" in line, line
    with pytest.raises(hf.HFError, match="cannot read weights"):
        hf.read_hf_folder(str(bad))


def test_a_bad_config_json_is_named(tmp_path, capsys, hf_folder):
    bad = tmp_path / "hf"
    shutil.copytree(hf_folder, bad)
    (bad / "config.json").write_bytes(b"[1, 2]")
    assert "holds a JSON list, not an object" in refused(generate.main, ["--hf", str(bad)], capsys)
    (bad / "config.json").write_bytes(b"\xff\xfe{")
    assert "config.json': UnicodeDecodeError" in refused(generate.main, ["--hf", str(bad)], capsys)


@pytest.mark.parametrize("argv, words", [
    # Before: taken as --dtype bfloat16 (prefix matching), and the export written in bf16.
    (["--run_dir", "RUN", "--out", "OUT", "--dtyp", "bfloat16"],
     "unrecognized arguments: --dtyp bfloat16; '--dtyp': did you mean '--dtype'?"),
    (["--run_dir", "RUN", "--out", "OUT", "--max_shard=2GB"],
     "unrecognized arguments: --max_shard=2GB; '--max_shard=2GB': did you mean '--max_shard_size'?"),
    # Before: only "required: --run_dir": the subcommand checks its required flags before the typo is named.
    (["--run-dir", "RUN", "--out", "OUT"],
     "the following arguments are required: --run_dir; '--run-dir': did you mean '--run_dir'?"),
], ids=["abbreviated", "abbreviated_with_value", "misspelt_required"])
def test_export_takes_no_abbreviated_flag_and_names_a_near_miss(tmp_path, capsys, argv, words):
    """A flag is its whole name: a prefix or a near miss is one line that names the flag meant, before anything is
    read or written."""
    paths = {"RUN": str(tmp_path / "run"), "OUT": str(tmp_path / "out")}
    line = refused(hf.main, ["export", *(paths.get(w, w) for w in argv)], capsys)
    assert line == f"error: {words}; see --help", line
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("main, argv, words", [
    # Before: taken as --max_new_tokens and --smooth (prefix matching).
    (generate.main, ["--run_dir", "RUN", "--max_new", "5"],
     "unrecognized arguments: --max_new 5; '--max_new': did you mean '--max_new_tokens'?"),
    (plot.main, ["RUN", "--out", "OUT", "--smo", "3"], "unrecognized arguments: --smo 3; '--smo': did you mean '--smooth'?"),
    (plot.main, ["RUN", "--smo", "3"],  # a required flag missing too: the near miss is named all the same
     "the following arguments are required: --out; '--smo': did you mean '--smooth'?"),
], ids=["generate", "plot", "plot_required"])
def test_no_command_takes_an_abbreviated_flag(tmp_path, capsys, main, argv, words):
    """core.cli.ArgumentParser takes flags by their whole name in every command (hf.py's test above)."""
    paths = {"RUN": str(tmp_path / "run"), "OUT": str(tmp_path / "out.png")}
    line = refused(main, [paths.get(w, w) for w in argv], capsys)
    assert line == f"error: {words}; see --help", line
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_export_refuses_an_existing_file_or_folder_and_leaves_it(tmp_path, tmp_path_factory, capsys):
    run = debug_run_dir(tmp_path_factory)
    afile = tmp_path / "model"
    afile.write_bytes(b"precious\n")
    line = refused(hf.main, ["export", "--run_dir", run, "--out", str(afile)], capsys)
    assert f"--out '{afile}' is a file" in line and "choose a folder path" in line
    assert afile.read_bytes() == b"precious\n"
    full = tmp_path / "full"
    (full / "sub").mkdir(parents=True)
    (full / "keep.txt").write_bytes(b"keep")
    (full / "sub" / "model.safetensors").write_bytes(b"old weights")
    before = _tree(full)
    line = refused(hf.main, ["export", "--run_dir", run, "--out", str(full)], capsys)
    assert f"--out '{full}' exists and is not empty" in line
    line = refused(hf.main, ["export", "--run_dir", run, "--out", str(afile / "below")], capsys)
    assert "cannot create a folder in" in line and "choose a writable location" in line
    assert _tree(full) == before and afile.read_bytes() == b"precious\n"
    assert sorted(os.listdir(tmp_path)) == ["full", "model"]  # no half-written export left behind
    assert "--max_shard_size: '0'" in refused(hf.main, ["export", "--run_dir", run, "--out", str(tmp_path / "x"),
                                                         "--max_shard_size", "0"], capsys)
    assert "required: --run_dir, --out" in refused(hf.main, ["export"], capsys)


@pytest.mark.slow
def test_a_run_without_checkpoints_or_with_a_damaged_one(tmp_path, tmp_path_factory, capsys):
    run = debug_run_dir(tmp_path_factory)
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copyfile(os.path.join(run, "config.toml"), bare / "config.toml")
    os.symlink(os.path.join(run, "data"), bare / "data")
    line = refused(hf.main, ["export", "--run_dir", str(bare), "--out", str(tmp_path / "out")], capsys)
    assert "no complete checkpoint in" in line and not (tmp_path / "out").exists()
    # The same run with one checkpoint shard cut short: the metadata reads, the weights do not.
    shutil.copytree(os.path.join(run, "checkpoints"), bare / "checkpoints")
    ckpt = next((bare / "checkpoints").iterdir())
    for shard in ckpt.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:1000])
    line = refused(generate.main, ["--run_dir", str(bare), "--max_new_tokens", "2"], capsys)
    assert f"checkpoint '{ckpt}' is damaged" in line and "pick another with --checkpoint" in line, line


@pytest.mark.parametrize("argv, words", [
    (["--max_sequences", "-1"], "argument --max_sequences: expected an int >= 0, got '-1'"),
    (["--micro_batch_size", "x"], "argument --micro_batch_size"),
    (["--split", "test"], "argument --split: invalid choice: 'test'"),
    (["--train.device", "banana"], "train.device must be 'auto', 'cuda' or 'cpu', got 'banana'"),
    (["--train.dtype", "fp8"], "train.dtype must be 'auto', 'bfloat16' or 'float32', got 'fp8'"),
    (["--data.seq_len", "0"], "data.seq_len (0) must be in 1..model.max_seq_len"),
    (["--train.seed", "99999999999999999999999"], "train.seed: 99999999999999999999999 is out of range"),
])
@pytest.mark.slow
def test_evaluate_refuses_bad_input_before_the_process_group(tmp_path_factory, capsys, argv, words):
    line = refused(evaluate.main, ["--run_dir", debug_run_dir(tmp_path_factory), *argv], capsys)
    assert words in line, line


def test_evaluate_names_a_missing_run(tmp_path, capsys):
    assert f"run directory '{tmp_path / 'nope'}' has no config.toml" in refused(
        evaluate.main, ["--run_dir", str(tmp_path / "nope")], capsys)


@pytest.mark.parametrize("script, argv, words", [
    ("generate.py", ["--run_dir", "nope", "--device", "banana"], "argument --device: 'banana' is not a device"),
    ("train_fsdp.py", ["--config", "{bad}"], "is not UTF-8 text"),
])
@pytest.mark.slow
def test_a_real_command_line_prints_one_line_and_exits_2(tmp_path, script, argv, words):
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"\xff\xfe")
    argv = [a.replace("{bad}", str(bad)) for a in argv]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, script), *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("error: ") and words in proc.stderr.splitlines()[0], proc.stderr
    assert proc.stdout == "" and bad.read_bytes() == b"\xff\xfe"


@pytest.mark.parametrize("where", ["s3://b/x", "s3:/b/x", "/proc/forbidden/t"])
def test_an_output_that_is_a_url_or_cannot_be_made_is_one_line_and_nothing_is_created(tmp_path, capsys, monkeypatch,
                                                                                      where):
    """hf.py export --out and prepare.py tokenizer --out: refused before any work, no local 's3:' tree."""
    import prepare

    monkeypatch.chdir(tmp_path)
    if "://" in where or where.startswith("s3:/"):
        with pytest.raises(hf.HFError, match="is a URL; export to a local folder"):
            hf.check_out(where)
    line = refused(prepare.main, ["tokenizer", "--config", DEBUG, "--out", where], capsys)
    assert "--out" in line and "cannot be written" in line or "must be a local directory" in line, line
    assert os.listdir(tmp_path) == []
