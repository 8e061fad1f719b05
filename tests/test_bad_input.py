"""Every bad input fails early with one short message naming the field or file and the fix,
exits with status 2, and leaves an existing run directory exactly as it was."""
import hashlib
import json
import os
import re
import shutil

import pytest

import checkpoint as ckpt_lib
import data
import train_fsdp
from data_pipeline import sources, tokenizer
from launch import (
    DEBUG,
    REFERENCE_ARGS,
    REFERENCE_BATCH,
    debug_run,
    debug_run_in_process,
    losses,
    main_in_process,
    metrics,
    prepared_data_dir,
)
from parallel import distributed
from storage.rundir import lock_run_dir


def _snapshot(rd):
    """Every file with its mtime and size; the run-directory lock (rewritten by whoever takes it) aside."""
    return sorted((os.path.join(d, f), os.path.getmtime(os.path.join(d, f)), os.path.getsize(os.path.join(d, f)))
                  for d, _, fs in os.walk(rd) for f in fs if f != ".lock")


@pytest.fixture(scope="module")
def existing_run(tmp_path_factory):
    """A finished 2-step run: bad input must leave it untouched."""
    rd = tmp_path_factory.mktemp("existing")
    prepared_data_dir(rd)
    with pytest.MonkeyPatch.context() as mp:
        debug_run_in_process(mp, None, rd, "--train.steps", "2", "--checkpoint.interval", "1")
    return rd


def _main_in_process(monkeypatch, capsys, *argv, world_size=1):
    """train_fsdp.main with the debug config in this process (launch.main_in_process)."""
    return main_in_process(monkeypatch, capsys, "--config", DEBUG, *argv, world_size=world_size)


@pytest.fixture(scope="module")
def big_tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizer.train_tokenizer([f"w{i} " * 3 for i in range(3000)], 600, 10 ** 6).save(str(path))
    return str(path)


PRE_GROUP = [
    (["--checkpoint.dir", "/proc/forbidden/ckpt"], "--checkpoint.dir '/proc/forbidden/ckpt' cannot be written"),
    (["--data.tokenizer", os.path.dirname(DEBUG)], f"data.tokenizer: '{os.path.dirname(DEBUG)}' is a folder; give the "
                                                   f"tokenizer.json file in it"),
    (["--train.stpes", "3"], "unknown config key 'train.stpes'; did you mean 'train.steps'?"),
    (["--optim.lr", "fast"], "optim.lr: expected float, got 'fast'"),
    (["--model.n_heads", "3"], "model.dim (128) must be divisible by model.n_heads (3)"),
    (["--model.n_kv_heads", "3"], "model.n_heads (4) must be divisible by model.n_kv_heads (3)"),
    (["--parallel.tp", "2"], "tensor parallelism runs with train_2d.py"),
    (["--data.seq_len", "1024"], "data.seq_len (1024) must be in 1..model.max_seq_len (512)"),
    (["--data.tokenizer_vocab_size", "8000"], "data.tokenizer_vocab_size (8000) is larger than model.vocab_size (4096)"),
    (["--data.dataset", "/nonexistent/*.jsonl"], "data.dataset: no file matches '/nonexistent/*.jsonl'"),
    (["--data.tokenizer", "/nonexistent/tokenizer.json"], "data.tokenizer: file '/nonexistent/tokenizer.json' not found"),
    (["--train.dtype", "fp8"], "train.dtype must be 'auto', 'bfloat16' or 'float32', got 'fp8'"),
    (["--train.activation_checkpointing", "some"], "train.activation_checkpointing must be"),
    (["--optim.beta1", "1.5"], "optim.beta1 must be in [0, 1), got 1.5"),
    (["--optim.eps", "-1"], "optim.eps must be > 0, got -1.0"),
    (["--optim.name", "sgd"], "optim.name must be 'adamw' or 'muon', got 'sgd'"),
    (["--optim.schedule", "step"], "optim.schedule must be 'cosine', 'wsd' or 'linear', got 'step'"),
    (["--optim.decay_fraction", "0"], "optim.decay_fraction is a fraction of train.steps: it must be in (0, 1], got 0.0"),
    (["--optim.decay_fraction", "1.5"], "optim.decay_fraction is a fraction of train.steps: it must be in (0, 1]"),
    (["--optim.decay_shape", "cos"], "optim.decay_shape must be 'linear' or '1-sqrt', got 'cos'"),
    (["--optim.muon_momentum", "1"], "optim.muon_momentum must be in [0, 1), got 1.0"),
    (["--train", "3"], "'train' is a section: set its fields as --train.FIELD value"),
    (["--train.val_interval", "-1"], "train.val_interval must be >= 0, got -1"),
    (["--checkpoint.keep", "-2"], "checkpoint.keep must be >= 0, got -2"),
    (["--train.seed", "-1"], "train.seed must be in 0..2**32-1, got -1"),
    (["--model.rope_theta", "inf"], "model.rope_theta must be a finite number > 0, got inf"),
    (["--train.collective_timeout_s", "inf"], "train.collective_timeout_s must be a number of seconds in [1, 1e7]"),
    (["--train.collective_timeout_s", "0.001"], "train.collective_timeout_s must be a number of seconds in [1, 1e7], "
                                                "got 0.001; the default is 300"),
    (["--train.z_loss", "-1e-4"], "train.z_loss must be a finite number >= 0 (0: off), got -0.0001"),
    (["--train.spike_skip", "nan"], "train.spike_skip must be a finite number >= 0 (0: off), got nan"),
    (["--train.spike_window", "1"], "train.spike_window must be >= 2 steps"),
    (["--model.parametrization", "mu"], "model.parametrization must be one of sp, mup, completep, got 'mu'"),
    (["--model.parametrization", "mup", "--model.base_dim", "256"], "a divisor of model.dim (128) in 1..128"),
    (["--model.parametrization", "mup", "--model.base_dim", "48"], "a divisor of model.dim (128) in 1..128 (e.g. 16, "
                                                                   "32, 64), got 48"),
    (["--model.parametrization", "completep", "--model.base_dim", "64"], "completep needs model.base_n_layers"),
    (["--model.base_dim", "64"], "model.base_dim and model.base_n_layers apply only under model.parametrization mup"),
    (["--model.parametrization", "mup", "--model.base_dim", "64", "--model.mup_output_mult", "0"],
     "model.mup_output_mult must be a finite number > 0 (1: the default), got 0.0"),
    (["--model.mup_input_mult", "4"], "model.mup_input_mult applies only under model.parametrization mup or completep; "
                                      "set --model.parametrization mup (or completep) with --model.base_dim, the "
                                      "proxy's width, or drop it"),
    (["--model.parametrization", "mup", "--model.base_dim", "64", "--model.base_head_dim", "48"],
     "model.base_head_dim is the proxy's head_dim: an even number in 2..head_dim (32), or 0 for head_dim itself, got 48"),
    # 59B parameters: refused before build_model allocates them (it was an allocator traceback or the OOM killer)
    (["--model.n_experts", "100000", "--model.experts_per_token", "2"],
     "the model does not fit: its 59.03B parameters need at least 879.7 GiB on a rank for parameters, gradients and "
     "adamw state (16 bytes each over 1 rank(s) holding distinct shards, before activations), and a rank has "),
]


@pytest.mark.slow
@pytest.mark.parametrize("argv, msg", PRE_GROUP)
def test_bad_config_fails_before_any_collective(existing_run, monkeypatch, capsys, argv, msg):
    before = _snapshot(existing_run)
    rc, err = _main_in_process(monkeypatch, capsys, "--run_dir", str(existing_run), *argv)
    assert rc == 2
    assert err.startswith("error: ") and msg in err and err.count("\n") == 1, err
    assert _snapshot(existing_run) == before


@pytest.mark.slow
def test_global_batch_not_divisible_by_world_size(existing_run, monkeypatch, capsys):
    rc, err = _main_in_process(monkeypatch, capsys, "--run_dir", str(existing_run),
                               "--train.global_batch_size", "15", world_size=2)
    assert rc == 2 and "train.global_batch_size (15) must be a positive multiple of data-parallel size (2)" in err


CP_LAYOUTS = [  # (argv, world size, message): context parallelism's layout, before the process group
    (["--parallel.cp", "2", "--data.seq_len", "127"], 2, "data.seq_len (127) is not divisible by parallel.cp (2): "),
    (["--parallel.cp", "2"], 3, "world size 3 is not divisible by parallel.cp (2); launch a multiple of 2"),
    (["--parallel.cp", "2", "--parallel.dp_replicate", "2"], 2,
     "parallel.dp_replicate (2) does not divide the 1 data-parallel rank(s) (world size 2 / (parallel.cp 2 x"),
    (["--parallel.cp", "4"], 4, "model.n_kv_heads (2) is not divisible by parallel.cp (4): Ulysses attention gives "
                                "every CP rank whole heads; use parallel.cp in [1, 2]"),
    (["--parallel.cp", "0"], 1, "parallel.cp must be >= 1, got 0"),
]


@pytest.mark.parametrize("argv, world_size, msg", CP_LAYOUTS)
def test_bad_context_parallel_layout_fails_before_any_collective(tmp_path, monkeypatch, capsys, argv, world_size, msg):
    def reached(*args, **kwargs):
        raise AssertionError("the process group was being created: the layout was not checked first")

    monkeypatch.setattr(distributed, "init_distributed", reached)
    rd = tmp_path / "run"
    rc, err = _main_in_process(monkeypatch, capsys, "--run_dir", str(rd), *argv, world_size=world_size)
    assert rc == 2 and err.startswith("error: ") and msg in err and err.count("\n") == 1, err
    assert not rd.exists()  # checked before config.validate creates the run directory


BATCH_STAGES = [
    ("[[train.batch_stages]]\nstart_step = 10\nglobal_batch_size = 32\n"
     "[[train.batch_stages]]\nstart_step = 5\nglobal_batch_size = 64\n",
     "train.batch_stages[1].start_step (5) must be > 10 (the previous stage's)"),
    ("[[train.batch_stages]]\nstart_step = 10\nglobal_batch_size = 8\n",
     "train.batch_stages[0].global_batch_size (8) must be larger than the batch before it (16)"),
    ("[[train.batch_stages]]\nstart_step = 10\nglobal_batch_size = 33\n",
     "train.batch_stages[0].global_batch_size (33) must be a positive multiple of data-parallel size (2)"),
    ("[[train.batch_stages]]\nstart_step = 10\nglobal_batch_size = 20\n",
     "train.batch_stages[0].global_batch_size (20) must be a positive multiple of data-parallel size (2) x "
     "train.micro_batch_size (8) = 16"),
]


@pytest.mark.slow
@pytest.mark.parametrize("tables, msg", BATCH_STAGES, ids=["start_not_increasing", "batch_not_growing",
                                                           "batch_not_divisible", "not_whole_micro_batches"])
def test_bad_batch_stages_fail_before_any_collective(existing_run, tmp_path, monkeypatch, capsys, tables, msg):
    config = tmp_path / "stages.toml"
    config.write_text(open(DEBUG).read() + "\n" + tables)
    before = _snapshot(existing_run)
    monkeypatch.setenv("WORLD_SIZE", "2")
    extra = ["--train.micro_batch_size", "8"] if "micro" in msg else []
    rc = train_fsdp.main(["--config", str(config), "--run_dir", str(existing_run), *extra])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and msg in err and err.count("\n") == 1, err
    assert _snapshot(existing_run) == before


ROLLBACK_INPUT = [  # (tables, argv, message): [[train.skip]] and train.rollback, before any collective
    ("[[train.skip]]\nstart_step = 10\nend_step = 20\n[[train.skip]]\nstart_step = 20\n", [],
     "train.skip[1]: no end_step given; every [[train.skip]] table needs start_step and end_step"),
    ("[[train.skip]]\nstart_step = 10\nend_step = 5\n", [],
     "train.skip[0]: start_step (10) must be >= 1 and end_step (5) >= start_step"),
    ("", ["--train.rollback", "2", "--train.rollback_after", "0"],
     "train.rollback_after must be >= 1 consecutive outlier steps with train.rollback on, got 0"),
    ("", ["--train.rollback", "2", "--checkpoint.interval", "5", "--train.rollback_margin", "20"],
     "train.rollback_margin (20) reaches further back than the checkpoints kept: a rollback needs one 21 steps "
     "before the divergent step (rollback_margin + rollback_after - 1), but checkpoint.keep 3 x "
     "checkpoint.interval 5 keeps as few as 15"),
    ("", ["--train.rollback", "2", "--checkpoint.interval", "200"],
     "train.rollback needs checkpoints to roll back to, but checkpoint.interval (200) saves only at the end of "
     "train.steps (200)"),
    ("", ["--train.rollback", "-1"], "train.rollback must be >= 0 (0: off), got -1"),
]


@pytest.mark.slow
@pytest.mark.parametrize("tables, argv, msg", ROLLBACK_INPUT, ids=["no_end_step", "reversed", "after_0",
                                                                  "margin_past_kept", "no_checkpoints", "negative"])
def test_bad_rollback_settings_fail_before_any_collective(existing_run, tmp_path, monkeypatch, capsys, tables, argv,
                                                          msg):
    config = tmp_path / "skips.toml"
    config.write_text(open(DEBUG).read() + "\n" + tables)
    before = _snapshot(existing_run)
    monkeypatch.setenv("WORLD_SIZE", "1")
    rc = train_fsdp.main(["--config", str(config), "--run_dir", str(existing_run), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and msg in err and err.count("\n") == 1, err
    assert _snapshot(existing_run) == before


@pytest.mark.slow
def test_tokenizer_larger_than_the_model(existing_run, monkeypatch, capsys, big_tokenizer):
    rc, err = _main_in_process(monkeypatch, capsys, "--run_dir", str(existing_run), "--data.tokenizer", big_tokenizer,
                               "--model.vocab_size", "512")
    assert rc == 2 and "has 600 tokens but model.vocab_size is 512" in err


@pytest.mark.parametrize("where, msg", [
    ("under_a_file", "cannot be written"),
    ("a_file", "cannot be written (it is a file, not a directory)"),
    ("/proc/forbidden/run", "cannot be written"),  # os.access says yes to root here; only trying tells
    ("s3://bucket/run", "must be a local directory; checkpoints can go to object storage with --checkpoint.dir s3://"),
    ("s3:/bucket/run", "must be a local directory"),
])
def test_unusable_run_directory_is_one_line_and_creates_nothing(tmp_path, monkeypatch, capsys, where, msg):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    run_dir = {"under_a_file": str(blocker / "run"), "a_file": str(blocker)}.get(where, where)
    monkeypatch.chdir(tmp_path)  # a URL taken for a local path would show up here as ./s3:/...
    rc, err = _main_in_process(monkeypatch, capsys, "--run_dir", run_dir)
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1 and msg in err, err
    assert sorted(os.listdir(tmp_path)) == ["a_file"]


def _errors(stderr):
    """The 'error: ...' lines of the ranks (a progress bar may share the line)."""
    return [line[line.index("error: "):] for line in stderr.splitlines() if "error: " in line]


def _bad_data_run(monkeypatch, capsys, rd, *argv):
    """A 1-rank run in this process: the data is read inside a gloo group of one, which its errors leave."""
    rc, err = _main_in_process(monkeypatch, capsys, "--run_dir", str(rd), "--train.steps", "2", *argv)
    return rc, _errors(err)


@pytest.mark.parametrize("files, extra, msg", [
    ({"a.txt": "", "b.txt": "  \n\n"}, [], "holds no non-empty document"),
    ({"a.jsonl": json.dumps({"body": "hello"}) + "\n"}, [], "data.text_column: column 'text' not in"),
    ({"a.jsonl": json.dumps({"text": 5}) + "\n"}, [], "holds int, not text"),
    ({"a.txt": b"caf\xe9 latin-1"}, [], "is not valid UTF-8 (byte 3"),
    ({"a.csv": "text\nhello"}, [], "use one of .txt, .jsonl, .parquet"),
    ({"a.jsonl": ""}, [], "holds no rows; point it at real data"),
])
@pytest.mark.slow
def test_bad_data_fails_with_the_file_and_leaves_no_data_behind(tmp_path, monkeypatch, capsys, files, extra, msg):
    src = tmp_path / "src"
    src.mkdir()
    for name, content in files.items():
        (src / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    rd = tmp_path / "run"
    rc, err = _bad_data_run(monkeypatch, capsys, rd, "--data.dataset", str(src), *extra)
    assert rc != 0 and len(set(err)) == 1 and msg in err[0], err
    assert not (rd / "data").exists() and not (rd / "metrics.jsonl").exists()


def test_undecodable_bytes_can_be_replaced_on_request(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_bytes(b"caf\xe9 " * 2000)
    cfg = data.DataConfig(dataset=str(src), decode_errors="replace")
    assert next(sources.iter_documents(cfg.source_list()[0])).startswith("caf\ufffd ")


@pytest.mark.slow
def test_changed_data_settings_on_an_existing_run_are_refused(existing_run, monkeypatch, capsys):
    before = _snapshot(existing_run)
    rc, err = _bad_data_run(monkeypatch, capsys, existing_run, "--data.max_documents", "10", "--train.steps", "3")
    assert rc != 0 and "was prepared with other data settings (data.max_documents: 400 -> 10)" in err[0]
    assert _snapshot(existing_run) == before


@pytest.mark.slow
def test_nonfinite_gradient_stops_without_touching_the_last_checkpoint(tmp_path):
    """The stop keeps checkpoint 1; its remedy, the same command with --train.nonfinite skip, resumes from it and
    gives a fresh run with that flag from the start: the same losses and skipped steps."""
    rd, ref = tmp_path / "nan", tmp_path / "ref"
    bad = ["--train.steps", "6", "--optim.lr", "1e30", "--optim.warmup_steps", "0", "--checkpoint.interval", "1",
           *REFERENCE_BATCH]
    for d in (rd, ref):
        prepared_data_dir(d)
    proc = debug_run(2, rd, *bad, check=False, timeout=120)
    err = _errors(proc.stderr)
    assert proc.returncode != 0 and err and "step 2: gradient norm is nan" in err[0], proc.stderr[-2000:]
    assert "pass --train.nonfinite skip" in err[0] and sorted(os.listdir(rd / "checkpoints")) == ["step_00000001"]
    debug_run(2, rd, *bad, "--train.nonfinite", "skip")
    debug_run(2, ref, *bad, "--train.nonfinite", "skip")
    got, want = ([(r["step"], r["loss"], r.get("skipped", False)) for r in metrics(d) if "loss" in r]
                 for d in (rd, ref))
    assert [s for s, _, _ in got] == list(range(1, 7)) and [k for _, _, k in got] == [False] + [True] * 5
    assert all(s == t and k == j and abs(a - b) <= 1e-6 * b for (s, a, k), (t, b, j) in zip(got, want))


@pytest.mark.slow
def test_a_checkpoint_with_a_missing_shard_file_is_named(tmp_path, reference):
    rd = tmp_path / "run"
    prepared_data_dir(rd)
    # The conftest reference's step 2: saved by 2 ranks at REFERENCE_BATCH, as this run would have trained it.
    shutil.copytree(reference / "checkpoints" / "step_00000002", rd / "checkpoints" / "step_00000002")
    shard = next((rd / "checkpoints" / "step_00000002").glob("__1_*.distcp"))
    shard.unlink()
    before = _snapshot(rd)
    proc = debug_run(2, rd, "--train.steps", "4", *REFERENCE_BATCH, check=False, timeout=120)
    err = _errors(proc.stderr)
    assert proc.returncode != 0 and err and f"is incomplete: '{shard.name}' is missing" in err[0], proc.stderr[-2000:]
    assert _snapshot(rd) == before


@pytest.mark.slow
def test_changed_model_settings_on_resume_are_refused(existing_run, monkeypatch, capsys):
    before = _snapshot(existing_run)
    rc, err = _bad_data_run(monkeypatch, capsys, existing_run, "--model.rope_theta", "500000", "--train.steps", "3")
    assert rc != 0 and "saved with other settings (model.rope_theta: checkpoint 10000.0, now 500000.0)" in err[0]
    assert _snapshot(existing_run) == before


@pytest.mark.slow
def test_a_changed_seq_len_on_resume_is_refused(existing_run, monkeypatch, capsys):
    before = _snapshot(existing_run)
    rc, err = _bad_data_run(monkeypatch, capsys, existing_run, "--data.seq_len", "64", "--train.steps", "3")
    assert rc != 0 and "data.seq_len: checkpoint 128, now 64" in err[0], err
    assert _snapshot(existing_run) == before


def test_the_batch_error_names_only_what_the_user_set(tmp_path, monkeypatch, capsys):
    rc, err = _main_in_process(monkeypatch, capsys, "--run_dir", str(tmp_path / "run"),
                               "--train.global_batch_size", "15", world_size=2)
    assert rc == 2 and "micro_batch_size" not in err and "so that every rank takes an equal share" in err
    rc, err = _main_in_process(monkeypatch, capsys, "--run_dir", str(tmp_path / "run"),
                               "--train.micro_batch_size", "3", world_size=2)
    assert rc == 2 and "data-parallel size (2) x train.micro_batch_size (3) = 6" in err


@pytest.mark.slow
def test_a_run_directory_in_use_stops_a_second_run(existing_run, monkeypatch, capsys):
    before = _snapshot(existing_run)
    holder = lock_run_dir(str(existing_run))  # another run, as far as the lock can tell
    try:
        rc, err = _main_in_process(monkeypatch, capsys, "--run_dir", str(existing_run), "--train.steps", "3")
    finally:
        holder.close()
    assert rc == 2 and f"--run_dir '{existing_run}' is in use by a run with pid {os.getpid()}" in err
    assert _snapshot(existing_run) == before


@pytest.mark.slow
def test_a_damaged_checkpoint_is_named_on_resume(existing_run, tmp_path, monkeypatch, capsys):
    rd = tmp_path / "run"
    shutil.copytree(existing_run, rd)
    newest = ckpt_lib.complete_checkpoints(str(rd / "checkpoints"))[-1][1]
    shard = os.path.join(newest, "__0_0.distcp")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    rc, err = _bad_data_run(monkeypatch, capsys, rd, "--train.steps", "3")
    assert rc != 0 and f"checkpoint '{newest}' is damaged, it cannot be read (rank 0:" in err[0], err


@pytest.mark.slow
def test_an_empty_new_checkpoint_dir_on_a_run_with_checkpoints_is_refused(existing_run, tmp_path, monkeypatch,
                                                                          capsys):
    """A job moved to a new location (or a typo in checkpoint.dir) must not start over and drop the run's history."""
    def digest(name):
        with open(os.path.join(existing_run, name), "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()

    kept = {name: digest(name) for name in ("metrics.jsonl", "config.toml")}
    new = tmp_path / "elsewhere"
    rc, err = _main_in_process(monkeypatch, capsys, "--run_dir", str(existing_run), "--checkpoint.dir", str(new))
    assert rc == 2 and err.count("\n") == 1, err
    assert f"checkpoint.dir {new} holds no checkpoint, but run directory {existing_run} has its checkpoints in " \
           f"{existing_run}/checkpoints (newest: step" in err and "--checkpoint.load_from" in err, err
    assert {name: digest(name) for name in kept} == kept and not any(new.iterdir() if new.exists() else [])
    # The remedy as printed, on a copy: the named --checkpoint.load_from continues the run as its own resume does.
    run, ref = tmp_path / "copy", tmp_path / "ref"
    for d in (run, ref):
        shutil.copytree(existing_run, d)
    _, err = _main_in_process(monkeypatch, capsys, "--run_dir", str(run), "--checkpoint.dir", str(new))
    named = re.search(r"pass --checkpoint\.load_from (\S+?),? ", err).group(1)
    assert named.startswith(str(run / "checkpoints")), err
    more = ["--train.steps", "4", "--checkpoint.interval", "1"]
    debug_run_in_process(monkeypatch, capsys, run, "--checkpoint.dir", str(new), "--checkpoint.load_from", named, *more)
    debug_run_in_process(monkeypatch, capsys, ref, *more)
    got, want = losses(run), losses(ref)
    assert sorted(got) == [1, 2, 3, 4] and all(abs(got[k] - want[k]) <= 1e-6 * want[k] for k in want)


@pytest.mark.slow  # the existing_run fixture trains
def test_load_from_a_checkpoint_of_another_tokenizer_is_refused(existing_run, big_tokenizer, tmp_path, monkeypatch,
                                                                 capsys):
    """This run's tokenizer (data.tokenizer) encodes otherwise than the checkpoint's: one line naming both."""
    rd = tmp_path / "other_tokenizer"
    start = str(existing_run / "checkpoints" / "step_00000002")
    rc, err = _main_in_process(monkeypatch, capsys, "--run_dir", str(rd), "--checkpoint.load_from", start,
                               "--data.tokenizer", big_tokenizer)
    assert rc == 2 and err.count("\n") == 1, err
    assert f"was trained with the tokenizer {existing_run}/data/tokenizer.json" in err and big_tokenizer in err, err
    assert not rd.exists()



@pytest.mark.slow
def test_fewer_steps_than_done_is_refused_and_the_printed_fix_continues_the_run(existing_run, tmp_path, monkeypatch,
                                                                                capsys):
    """--train.steps 1 after 2 steps: nothing can run; it used to print 'finished: step 2 of 1' and rewrite config.toml."""
    before = _snapshot(existing_run)
    rc, err = _main_in_process(monkeypatch, capsys, "--run_dir", str(existing_run), "--train.steps", "1")
    ckpt = existing_run / "checkpoints" / "step_00000002"
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert rc != 0 and errors == [
        f"error: train.steps (1) is below the 2 steps already done in {ckpt}: pass --train.steps above 2 to continue "
        f"this run, or branch from an earlier checkpoint with --checkpoint.load_from and a new --run_dir"], err
    assert _snapshot(existing_run) == before
    # The fix as printed, in a copy: a train.steps above 2 continues the run at step 3.
    copy = tmp_path / "copy"
    shutil.copytree(existing_run, copy)
    proc = debug_run_in_process(monkeypatch, capsys, copy, "--train.steps", "3", "--checkpoint.interval", "1")
    assert "[train] finished: step 3 of 3" in proc.stdout
    assert [r["step"] for r in metrics(copy) if "loss" in r] == [1, 2, 3]


@pytest.mark.slow
def test_a_finished_run_started_again_with_a_lower_lr_leaves_its_run_directory_as_it_was(existing_run, monkeypatch,
                                                                                          capsys):
    """No step runs at the new optim.lr, so config.toml keeps the LR the run ran at (and nothing else is rewritten)."""
    before = _snapshot(existing_run)
    config = (existing_run / "config.toml").read_text()
    proc = debug_run_in_process(monkeypatch, capsys, existing_run, "--train.steps", "2", "--optim.lr", "1e-5")
    assert "[train] finished: step 2 of 2 already; nothing to run, the run directory is left as it was" in proc.stdout
    assert (existing_run / "config.toml").read_text() == config and _snapshot(existing_run) == before


@pytest.mark.slow  # the existing_run fixture trains
def test_a_checkpoint_that_cannot_continue_is_refused_before_any_data_is_prepared(existing_run, tmp_path, monkeypatch,
                                                                                  capsys):
    """docs/optimizers.md's anneal from another optimizer's checkpoint: refused before minutes of tokenizing."""
    rd = tmp_path / "anneal"
    start = str(existing_run / "checkpoints" / "step_00000002")
    rc, err = _main_in_process(monkeypatch, capsys, "--run_dir", str(rd), "--checkpoint.load_from", start,
                               "--optim.name", "muon", "--train.steps", "4")
    assert rc == 2 and "holds the state of optim.name 'adamw', but this run has 'muon'" in err, err
    assert not (rd / "data").exists() and not (rd / "data.tmp").exists()


@pytest.mark.slow
def test_ctrl_c_before_the_loop_keeps_what_was_saved_and_the_same_command_resumes(tmp_path, reference, monkeypatch,
                                                                                  capsys):
    """A Ctrl-C while the run is being built: one line, nothing touched, and the same command resumes the run."""
    from training import command

    rd = tmp_path / "early"
    prepared_data_dir(rd)
    debug_run(2, rd, *REFERENCE_ARGS, "--train.steps", "4")

    def files():
        return sorted((p, os.path.getmtime(os.path.join(d, p)), os.path.getsize(os.path.join(d, p)))
                      for d, _, names in os.walk(rd) for p in names if p != ".lock")

    before = files()

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(command, "build", interrupted)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_PORT", str(distributed.free_port()))
    assert train_fsdp.main(["--config", DEBUG, "--run_dir", str(rd), *REFERENCE_ARGS]) == 130
    assert "run the same command to resume" in capsys.readouterr().err
    assert files() == before
    debug_run(2, rd, *REFERENCE_ARGS)  # the same command, as the line says
    want, got = losses(reference), losses(rd)
    assert sorted(got) == list(range(1, 11)) and max(abs(got[s] - want[s]) / want[s] for s in want) <= 1e-6
