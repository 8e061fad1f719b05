"""Checkpoints on an S3-compatible server (a real moto_server on 127.0.0.1, see tests/s3server.py):
bad locations refused in one line before anything starts; a run killed during an upload, resumed at
another world size from the bucket, with a store outage in the middle, equals the uninterrupted local run;
two torchrun agents as two nodes share nothing but the bucket."""
import json
import os
import sys
import threading
import time

import pytest
import s3fs
import torch

import checkpoint as ckpt_lib
import generate
import hf
import prepare
import train_fsdp
from config import parse_config
from core.errors import UserError
from data import DataError
from data_pipeline import datacache
from launch import (
    DEBUG,
    REFERENCE_ARGS,
    debug_run_in_process,
    losses,
    metrics,
    prepared_data_dir,
    spawn,
    start,
    torchrun_command,
    wait_for_step,
)
from model import PRESETS, ModelArgs, Transformer
from parallel import distributed
from s3server import Relay
from storage import fs
from training import rollback

BUCKET = "tests"
"""The bucket of conftest.py's `s3` fixture (S3_BUCKET)."""


@pytest.fixture(scope="module")
def published(s3, tmp_path_factory) -> str:
    """The URL of the debug corpus published by `prepare.py --data.prepared URL` (a run directory of its own)."""
    rd, url = tmp_path_factory.mktemp("prepare"), f"s3://{BUCKET}/data"
    prepared_data_dir(rd)  # tokenized once per session; prepare.py finds it prepared and publishes it
    assert prepare.main(["--config", DEBUG, "--run_dir", str(rd), "--data.prepared", url]) == 0
    return url


def _refused(monkeypatch, capsys, *argv) -> str:
    """train_fsdp.main in this process must stop with one 'error:' line and status 2; returns the line."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_PORT", str(distributed.free_port()))
    rc = train_fsdp.main(["--config", DEBUG, *argv])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_bad_checkpoint_locations_are_one_line_before_anything_starts(s3, tmp_path, monkeypatch, capsys):
    rd = str(tmp_path / "run")
    for bad, words in (("nosuch://b/p", "'nosuch://' is not supported: use a local path or s3://BUCKET/PREFIX"),
                       ("ftp://host/x", "'ftp://' is not supported"), ("gs://b/x", "'gs://' is not supported"),
                       ("file:///tmp/x", "give its path without file://"),
                       ("s3:/bucket/x", "looks like a URL with one slash, which would be a local folder named 's3:'")):
        start = time.perf_counter()
        line = _refused(monkeypatch, capsys, "--run_dir", rd, "--checkpoint.dir", bad)
        assert words in line and time.perf_counter() - start < 10, (bad, line)
    assert not os.path.exists("s3:")
    line = _refused(monkeypatch, capsys, "--run_dir", rd, "--checkpoint.dir", "s3://no-such-bucket/run")
    assert "bucket 'no-such-bucket' does not exist" in line and s3["AWS_ENDPOINT_URL"] in line
    line = _refused(monkeypatch, capsys, "--run_dir", rd, "--checkpoint.load_from", "s3://no-such-bucket/x")
    assert "--checkpoint.load_from" in line
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    line = _refused(monkeypatch, capsys, "--run_dir", rd, "--checkpoint.dir", f"s3://{BUCKET}/run")
    assert "no S3 credentials" in line and "AWS_ACCESS_KEY_ID" in line
    monkeypatch.setitem(sys.modules, "s3fs", None)  # as if s3fs were not installed
    line = _refused(monkeypatch, capsys, "--run_dir", rd, "--checkpoint.dir", f"s3://{BUCKET}/run")
    assert "'s3fs'" in line and '".[s3]"' in line
    assert not os.path.exists(os.path.join(rd, "checkpoints"))


def test_a_published_directory_prepared_otherwise_is_one_line_before_anything_starts(published, tmp_path,
                                                                                       monkeypatch, capsys):
    rd = str(tmp_path / "run")
    line = _refused(monkeypatch, capsys, "--run_dir", rd, "--data.prepared", published, "--data.max_documents", "10")
    assert "prepared with other data settings (source default max_documents: prepared 400, now 10)" in line
    line = _refused(monkeypatch, capsys, "--run_dir", rd, "--data.prepared", f"s3://{BUCKET}/nothing")
    assert "no meta.json there" in line
    assert not os.path.exists(os.path.join(rd, "data_cache"))


def test_storage_reads_writes_lists_and_removes_on_the_server(s3):
    root = f"s3://{BUCKET}/storage"
    fs.write_bytes(fs.join(root, "a", "x.bin"), b"123")
    assert fs.isfile(f"{root}/a/x.bin") and not fs.isfile(f"{root}/a")
    assert fs.listdir(root) == ["a"] and fs.listdir(f"{root}/none") == []
    assert fs.read_bytes(f"{root}/a/x.bin") == b"123"
    fs.remove(f"{root}/a")
    assert not fs.exists(f"{root}/a/x.bin")


def _fake_checkpoint(root: str, step: int) -> None:
    """A committed step directory of two objects (DCP's metadata and a shard) and the marker, the bytes naming it."""
    for name in (".metadata", "__0_0.distcp", ckpt_lib.COMMIT_MARKER):
        fs.write_bytes(fs.join(ckpt_lib.step_dir(root, step), name), f"{step}{name}".encode())


@pytest.mark.parametrize("where", ["local", "s3"])
def test_checkpoints_set_aside_move_whole_where_no_resume_looks(where, tmp_path, request):
    """A stop of train.rollback moves the steps after the one it names into a folder of its own, kept whole."""
    root = str(tmp_path / "ckpt") if where == "local" else f"s3://{BUCKET}/aside"
    if where == "s3":
        request.getfixturevalue("s3")
    for step in (3, 6, 9):
        if where == "local":
            os.makedirs(ckpt_lib.step_dir(root, step))
        _fake_checkpoint(root, step)
    assert rollback.set_aside(root, 9, 10) == ([], "")
    moved, folder = rollback.set_aside(root, 3, 10)
    assert moved == [6, 9] and folder == fs.join(root, "diverged_at_step_10")
    assert [s for s, _ in ckpt_lib.complete_checkpoints(root)] == [3]  # what a resume finds
    assert [s for s, _ in ckpt_lib.complete_checkpoints(folder)] == [6, 9]
    assert fs.read_bytes(fs.join(folder, "step_00000009", "__0_0.distcp")) == b"9__0_0.distcp"
    if where == "local":
        os.makedirs(ckpt_lib.step_dir(root, 6))
    _fake_checkpoint(root, 6)  # the next run saved step 6 again, and stopped at step 10 again
    assert rollback.set_aside(root, 3, 10) == ([6], fs.join(root, "diverged_at_step_10.2"))
    assert [s for s, _ in ckpt_lib.complete_checkpoints(folder)] == [6, 9]


@pytest.mark.slow
def test_a_store_gone_for_a_moment_is_retried_with_backoff(s3, monkeypatch):
    relay = Relay(int(s3["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]))
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{relay.port}")
    s3fs.S3FileSystem.clear_instance_cache()  # fsspec keeps one instance per settings, not per endpoint variable
    try:
        relay.down()
        threading.Timer(1.5, relay.up).start()
        started = time.monotonic()
        fs.write_bytes(f"s3://{BUCKET}/retried/x", b"1")  # botocore retries until the relay is back
        assert time.monotonic() - started >= 1.0 and fs.read_bytes(f"s3://{BUCKET}/retried/x") == b"1"
    finally:
        relay.down()
        s3fs.S3FileSystem.clear_instance_cache()


def _weights(path: str) -> dict[str, torch.Tensor]:
    sd = Transformer(ModelArgs(**PRESETS["debug"])).state_dict()
    ckpt_lib.read_model_weights(path, sd)
    return sd


def _store_steps(url: str) -> dict[str, bool]:
    """{step directory name: committed} under url."""
    return {n: ckpt_lib.is_complete(fs.join(url, n)) for n in fs.listdir(url) if n.startswith("step_")}


@pytest.mark.slow
def test_killed_during_an_upload_then_a_store_outage_resumes_from_the_bucket_like_the_local_run(
        s3, published, tmp_path, reference):
    # 1. Two torchrun agents as two nodes, each with a run directory of its own: they share only the
    #    bucket, which holds the data and the checkpoints (every 2 steps). Rank 0 is SIGKILLed once
    #    every shard of step 6 is uploaded, before the commit marker; its peer on the other node fails.
    url = f"s3://{BUCKET}/killed"
    common = [*REFERENCE_ARGS, "--checkpoint.dir", url, "--checkpoint.keep", "2", "--data.prepared", published]
    rendezvous = ("--nnodes=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{distributed.free_port()}",
                  "--rdzv-id=s3test")
    nodes = [spawn(torchrun_command(1, "tests/fault_worker.py", "--config", DEBUG, "--run_dir", tmp_path / f"node{i}",
                                    *common, launcher=rendezvous), tmp_path / f"node{i}.log",
                   env={"FAULT": "0:6:marker"}) for i in range(2)]
    assert all(p.wait(timeout=240) != 0 for p in nodes)
    steps = _store_steps(url)
    assert steps == {"step_00000002": True, "step_00000004": True, "step_00000006": False}, steps
    for i in range(2):  # each node downloaded tokenizer.json and the token file once into its own cache
        node = tmp_path / f"node{i}"
        assert sorted(os.listdir(node / "data_cache" / "sources")) == [os.path.basename(f) for f in
                                                                      fs.listdir(f"{published}/sources")]
        assert not os.path.exists(node / "checkpoints") and not os.path.exists(node / "data")
        log = (tmp_path / f"node{i}.log").read_text()
        assert log.count("[data] downloading") == 2, log[-3000:]
    rd = next(tmp_path / f"node{i}" for i in range(2) if os.path.exists(tmp_path / f"node{i}" / "metrics.jsonl"))
    args = ["--config", DEBUG, "--run_dir", rd, *common]

    # 2. One rank, through a relay to the server: resumes from step 4, removes the partial step 6,
    #    saves 6; the store goes down after step 7, so the save of step 8 fails with one line.
    relay = Relay(int(s3["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]))
    via_relay = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{relay.port}", "AWS_MAX_ATTEMPTS": "3"}
    proc = start(1, "train_fsdp.py", *args, log_path=tmp_path / "log2.txt", env=via_relay)
    wait_for_step(rd, 7, proc)
    relay.down()
    rc = proc.wait(timeout=240)
    log = (tmp_path / "log2.txt").read_text()
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    print(errors)
    assert rc != 0 and len(errors) == 1, log[-3000:]
    assert f"step 8 to {url} failed" in errors[0] and f"{url}/step_00000006, is untouched" in errors[0]
    assert f"resumed from {url}/step_00000004 at step 4" in log and f"removing {url}/step_00000006" in log
    assert "[data] downloading" not in log  # the node's cache is reused

    # 3. The store is back: the same command, saving asynchronously now, resumes from step 6 and
    #    finishes; keep 2 on the store.
    relay.up()
    proc = start(1, "train_fsdp.py", *args, "--checkpoint.async_save", "true", log_path=tmp_path / "log3.txt",
                 env=via_relay)
    assert proc.wait(timeout=240) == 0, (tmp_path / "log3.txt").read_text()[-3000:]
    assert f"resumed from {url}/step_00000006 at step 6" in (tmp_path / "log3.txt").read_text()
    relay.down()
    assert _store_steps(url) == {"step_00000008": True, "step_00000010": True}

    want, got = losses(reference), losses(rd)
    same = max(abs(got[s] - want[s]) / abs(want[s]) for s in range(1, 5))  # 2 ranks, before the kill
    other = max(abs(got[s] - want[s]) / abs(want[s]) for s in range(5, 11))  # 1 rank from step 4 on
    print(f"max relative loss difference vs the uninterrupted local run: steps 1-4 {same:.1e}, 5-10 {other:.1e}")
    assert same <= 1e-6 and other <= 1e-4
    assert [r["step"] for r in metrics(rd) if "loss" in r] == list(range(1, 11))

    # 4. The commands that read a run take the remote checkpoint (the run's checkpoint.dir).
    ref = _weights(ckpt_lib.complete_checkpoints(str(reference / "checkpoints"))[-1][1])
    remote = _weights(f"{url}/step_00000010")
    assert all(torch.allclose(remote[k], v, atol=1e-4) for k, v in ref.items())
    assert hf.main(["export", "--run_dir", str(rd), "--out", str(tmp_path / "hf")]) == 0
    model, _ = generate.load_model(str(rd))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in remote.items())


def test_a_corrupted_object_is_uploaded_again_by_publish_and_training_data_fetches(s3, tmp_path):
    """An object of the published data with the right size but other bytes: fetch refuses it and advises publishing
    again; publish compares SHA-256, not size, so it sends the object again, and fetch then succeeds."""
    rd, url = tmp_path / "run", f"s3://{BUCKET}/republish"
    prepared_data_dir(rd)
    local = str(rd / "data")
    datacache.publish(local, url)
    rel = next(r["file"] for r in datacache.read_meta(local)["sources"].values())
    good = fs.read_bytes(fs.join(url, rel))
    fs.write_bytes(fs.join(url, rel), bytes(b ^ 0xFF for b in good[:64]) + good[64:])
    cfg = parse_config(["--config", DEBUG, "--data.prepared", url]).data
    with pytest.raises(DataError, match="does not match its meta.json .* publish the directory again"):
        datacache.fetch(cfg, str(tmp_path / "cache1"))
    datacache.publish(local, url)
    assert fs.read_bytes(fs.join(url, rel)) == good
    folder, _ = datacache.fetch(cfg, str(tmp_path / "cache2"))
    with open(os.path.join(folder, rel), "rb") as f:
        assert f.read() == good


def _objects(url) -> dict[str, bytes]:
    store, inner = fs.filesystem(url)
    return {p: store.cat_file(p) for p in store.find(inner)}


@pytest.mark.slow
def test_a_second_run_on_one_checkpoint_dir_is_refused_and_the_first_keeps_every_byte(s3, tmp_path, monkeypatch,
                                                                                      capsys):
    """Run A owns s3://.../owned (owner.json); run B, another run directory on the same location, is refused in one
    line naming A, before it removes or writes anything: A's checkpoints, and an unfinished step of A in progress,
    stay byte for byte."""
    url, a, b = f"s3://{BUCKET}/owned", tmp_path / "a", tmp_path / "b"
    prepared_data_dir(a)
    debug_run_in_process(monkeypatch, capsys, a, "--train.steps", "4", "--checkpoint.interval", "2", "--checkpoint.dir",
                         url)  # 1 rank, in this process
    fs.write_bytes(f"{url}/step_00000006/__0_0.distcp", b"a save of run A in progress")
    before = _objects(url)
    assert json.loads(fs.read_bytes(f"{url}/owner.json")) == {"run_dir": str(a)}
    prepared_data_dir(b)
    line = _refused(monkeypatch, capsys, "--run_dir", str(b), "--checkpoint.dir", url, "--train.steps", "6")
    assert f"checkpoint.dir {url} belongs to the run in {a} ({url}/owner.json)" in line and "--checkpoint.load_from" \
        in line, line
    assert _objects(url) == before
    assert not os.path.exists(b / "metrics.jsonl")


def test_a_committed_step_on_the_store_is_never_rewritten(s3, single_rank_group):
    url = f"s3://{BUCKET}/rewrite"
    fs.write_bytes(f"{url}/step_00000004/.metadata", b"metadata")
    fs.write_bytes(f"{url}/step_00000004/.committed", b"")
    before = _objects(url)
    ckpt = ckpt_lib.Checkpointer(ckpt_lib.CheckpointConfig(dir=url), url, 0)
    with pytest.raises(UserError, match="step_00000004' is committed already and is never rewritten"):
        ckpt.save(4, None)
    assert _objects(url) == before
