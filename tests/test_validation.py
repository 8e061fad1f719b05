"""Validation's one rule (validation.py): every window once at any world size; the loss of a plain model; resharded after."""
import pytest
import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule

from config import parse_config
from data import PackedCorpus
from evaluation import validation
from launch import DEBUG, prepared_data_dir
from model import Transformer
from training.session import build
from training.step import train_step


@pytest.mark.parametrize("n", [1, 7, 10, 33])
def test_rank_shares_cover_every_window_once_and_every_rank_runs_as_many_forwards(tmp_path, n):
    prepared_data_dir(tmp_path)
    corpus = PackedCorpus(str(tmp_path / "data"), parse_config(["--config", DEBUG]).data)
    windows = [(0, corpus.n_train + i) for i in range(n)]
    for world in range(1, 6):
        for micro in (1, 2, 4):
            sets = [validation.val_set(corpus, "v", windows, micro, r, world) for r in range(world)]
            seen = torch.cat([x for v in sets for x, _ in v.batches])
            (want, _), = corpus.batches(windows, n)
            assert torch.equal(seen, want), (world, micro)  # every window once, in order
            assert len({v.n_forward for v in sets}) == 1 and all(len(v.batches) <= v.n_forward for v in sets)
            assert sets[0].n_windows == n


@pytest.mark.parametrize("reshard_after_forward", ["true", "false"])
def test_validation_loss_is_the_plain_models_and_leaves_the_parameters_sharded(
        tmp_path, single_rank_group, reshard_after_forward):
    prepared_data_dir(tmp_path)
    cfg = parse_config(["--config", DEBUG, "--run_dir", str(tmp_path), "--train.steps", "5",
                        "--parallel.reshard_after_forward", reshard_after_forward, "--train.loss_chunk_size", "64"])
    s = build(cfg, 0, 1, torch.device("cpu"), resume=False)
    train_step(s, s.loader.next_step())  # trained weights, and the step's backward resharded
    (vs,) = validation.val_batches(s.corpus, 8, 3, 0, 1)
    total, count = validation.loss_sum_and_count(s.runner, vs, None)
    groups = [m._get_fsdp_state()._fsdp_param_group for m in s.model.modules() if isinstance(m, FSDPModule)]
    assert groups and all(g is None or g.is_sharded for g in groups)

    plain = Transformer(cfg.model)  # the reference: an unsharded model with the same weights, full logits
    plain.load_state_dict({k: v.full_tensor() for k, v in s.model.state_dict().items()})
    with torch.no_grad():
        want = sum(F.cross_entropy(plain(x).flatten(0, 1), y.flatten(), reduction="sum").item() for x, y in vs.batches)
    assert count == 8 * cfg.data.seq_len
    assert abs(total - want) / want <= 1e-6
