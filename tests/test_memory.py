"""parallel/memory.py's floor on a rank's resident bytes, against what a real run keeps."""
import pytest
import torch

from config import parse_config
from core.errors import SetupError
from launch import DEBUG, prepared_data_dir
from parallel.memory import check_fits, resident_floor
from training.session import build
from training.step import train_step


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _state_bytes(s) -> int:
    """Bytes a session holds for parameters, their gradients (at the update, before zero_grad frees them) and the
    optimizer's state, over one step."""
    grads = []
    opts = getattr(s.optimizer, "optimizers", [s.optimizer])
    for opt in opts:
        opt.register_step_pre_hook(lambda o, args, kwargs: grads.append(
            _nbytes(p.grad for g in o.param_groups for p in g["params"])))
    train_step(s, s.loader.next_step())
    state = [t for opt in opts for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
    return _nbytes(s.model.parameters()) + sum(grads) + _nbytes(state)


@pytest.mark.slow
def test_the_floor_is_what_a_one_rank_run_keeps(tmp_path, single_rank_group):
    for optimizer in ("adamw", "muon"):
        prepared_data_dir(tmp_path / optimizer)
        cfg = parse_config(["--config", DEBUG, "--run_dir", str(tmp_path / optimizer), "--train.steps", "2",
                            "--optim.name", optimizer, "--checkpoint.keep", "0"])
        s = build(cfg, 0, 1, torch.device("cpu"))
        real, floor = _state_bytes(s), resident_floor(cfg.model, optimizer, 1)
        # AdamW: exact but for its per-tensor step counters; Muon: the floor counts one moment for every parameter
        assert floor <= real <= floor * (1.001 if optimizer == "adamw" else 1.5), (optimizer, floor, real)
        s.ckpt.close()


def test_the_floor_spreads_over_shards_not_replicas():
    cfg = parse_config(["--config", DEBUG])
    one = resident_floor(cfg.model, "adamw", 1)
    assert resident_floor(cfg.model, "adamw", 8) == -(-one // 8)
    assert resident_floor(cfg.model, "adamw", 8, dp_replicate=2) == -(-one // 4)  # HSDP: 2 replicas of 4 shards
    check_fits(cfg.model, "adamw", 1, 1, one, "exactly enough")  # no error
    with pytest.raises(SetupError, match=r"over 2 rank\(s\) holding distinct shards.*at least 3 GPUs of"):
        check_fits(cfg.model, "adamw", 2, 1, one // 2 - 1, "one byte short")
    # Two ranks sharing a machine's memory: more ranks there only split it further, so the remedy is machines.
    with pytest.raises(SetupError, match=r"run it on at least 2 machines with this memory$"):
        check_fits(cfg.model, "adamw", 2, 1, one // 2 - 1, "one byte short", sharing=2)
