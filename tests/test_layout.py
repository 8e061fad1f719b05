"""parallel/layout.py: every rank's groups by role, against groups written out by hand and against the groups
DeviceMesh itself makes (one process, the fake process group, at world sizes this machine cannot run)."""
from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from core.errors import SetupError
from parallel.layout import ROLES, Layout, ParallelConfig


def test_groups_of_a_pipeline_over_tensor_parallel_ranks_are_the_ones_written_out_by_hand():
    # world 8 = pp 2 x dp 2 x tp 2: rank = 4 pp + 2 dp + tp
    lay = Layout.of(ParallelConfig(pp=2, tp=2), 8)
    assert lay.coords(6) == {"pp": 1, "dp": 1, "tp": 0}
    assert lay.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.groups("data") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.groups("loss") == lay.groups("fsdp") == lay.groups("data")
    assert lay.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.groups("same_params") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lay.groups("cp") == lay.groups("ep") == [[r] for r in range(8)]  # no such group: each rank alone
    assert lay.stages(5) == [1] and lay.size("tp") == 2 and lay.size("cp") == 1


def test_groups_of_hsdp_with_context_parallelism_and_of_expert_parallelism_are_the_ones_written_out_by_hand():
    # world 8 = dp_replicate 2 x dp_shard 2 x cp 2: rank = 4 replica + 2 shard + cp
    lay = Layout.of(ParallelConfig(dp_replicate=2, cp=2), 8)
    assert lay.groups("data") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert lay.groups("cp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.groups("loss") == lay.groups("fsdp") == [list(range(8))]
    # world 8 = dp_mod_ep 2 x ep 4: consecutive ranks form an EP group; every 4th holds the same experts
    lay = Layout.of(ParallelConfig(ep=4), 8)
    assert lay.groups("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert lay.groups("experts_fsdp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.groups("data") == [list(range(8))]
    assert list(lay.experts(6, 8)) == [4, 5]


def test_ep_takes_in_the_cp_then_the_tp_ranks_only_where_the_data_parallel_ones_are_too_few():
    # world 8 = dp 2 x cp 4, ep 2: EP fits the 2 data-parallel ranks and keeps to them (every 4th rank)
    lay = Layout.of(ParallelConfig(ep=2, cp=4), 8)
    assert lay.ep_takes == () and lay.groups("ep") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.groups("experts_fsdp") == [[0, 1, 2, 3], [4, 5, 6, 7]]  # the CP ranks hold the same experts
    # world 8 = dp 2 x cp 4, ep 8: dp_in_ep 2 x cp 4, the whole world; each rank holds its own expert
    lay = Layout.of(ParallelConfig(ep=8, cp=4), 8)
    assert lay.ep_takes == ("cp",) and lay.groups("ep") == [list(range(8))]
    assert lay.groups("experts_fsdp") == [[r] for r in range(8)]
    assert [lay.experts(r, 8).start for r in range(8)] == list(range(8))
    # world 4 = dp 2 x cp 2 under HSDP (2 replicas of 1 shard rank), ep 2: the CP pair; replicas hold the same
    lay = Layout.of(ParallelConfig(ep=2, cp=2, dp_replicate=2), 4)
    assert lay.groups("ep") == [[0, 1], [2, 3]] and lay.groups("experts_fsdp") == [[0, 2], [1, 3]]
    assert lay.groups("loss") == [[0, 1, 2, 3]]
    # world 4 = dp 2 x tp 2, ep 4: too many for the data-parallel ranks, so dp_in_ep 2 x tp 2; the TP ranks' tokens
    # are their own (moe_sequence.py), and each rank holds its own experts
    lay = Layout.of(ParallelConfig(ep=4, tp=2), 4)
    assert lay.ep_takes == ("tp",) and lay.groups("ep") == [[0, 1, 2, 3]]
    assert lay.groups("experts_fsdp") == [[0], [1], [2], [3]] and lay.groups("tp") == [[0, 1], [2, 3]]
    # world 8 = dp 2 x cp 2 x tp 2, ep 8: the CP and the TP ranks too
    assert Layout.of(ParallelConfig(ep=8, cp=2, tp=2), 8).ep_takes == ("cp", "tp")


def test_an_interleaved_pipeline_puts_stage_r_and_r_plus_pp_on_rank_r_and_a_v_schedule_folds_back():
    assert Layout.of(ParallelConfig(pp=4, pp_schedule="Interleaved1F1B"), 4).stages(1) == [1, 5]
    assert Layout.of(ParallelConfig(pp=4, pp_schedule="ZBVZeroBubble"), 4).stages(1) == [1, 6]


LAYOUTS = [(ParallelConfig(), 4), (ParallelConfig(tp=2), 8), (ParallelConfig(dp_replicate=2, cp=2), 16),
           (ParallelConfig(pp=2, dp_replicate=2, tp=2), 16), (ParallelConfig(ep=4, dp_replicate=2), 16),
           (ParallelConfig(pp=2, ep=2, pp_schedule="Interleaved1F1B"), 8), (ParallelConfig(pp=2, cp=2, tp=2), 64),
           (ParallelConfig(ep=4, cp=2, tp=2), 8), (ParallelConfig(ep=4, cp=2, dp_replicate=2), 16),
           (ParallelConfig(ep=4, tp=2), 4), (ParallelConfig(ep=8, cp=2, tp=2), 8)]


def _ranks(m) -> list[int]:
    if isinstance(m, dist.ProcessGroup):
        return dist.get_process_group_ranks(m)
    return dist.get_process_group_ranks(m.get_group() if m.ndim == 1 else m._flatten().get_group())


@pytest.mark.parametrize("cfg, world", LAYOUTS, ids=[f"w{w}-{i}" for i, (_, w) in enumerate(LAYOUTS)])
def test_the_meshes_layout_builds_hold_the_ranks_it_computes_for_every_role(cfg, world):
    lay = Layout.of(cfg, world)
    lay.check()
    for rank in sorted({0, 1, world // 2 + 1, world - 1}):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            mesh = lay.build("cpu")
            for role in ROLES:
                built = getattr(mesh, role)
                assert (built is None) == (not lay.role_dims(role)) or role == "same_params", role
                if built is not None:
                    assert _ranks(built) == lay.members(role, rank), (role, rank)
                assert mesh.size(role) == len(lay.members(role, rank))
        finally:
            dist.destroy_process_group()


def test_a_layout_of_4096_ranks_lists_every_rank_without_starting_anything():
    lay = Layout.of(ParallelConfig(pp=4, dp_replicate=4, tp=8, pp_schedule="Interleaved1F1B"), 4096)
    lay.check(local_world_size=8)
    table = lay.table()
    assert len(table) == 4096 and not dist.is_initialized()
    assert table[4095] == ("rank 4095 {'pp': 3, 'dp_replicate': 3, 'dp_shard': 31, 'tp': 7} data 3079-4095 step 8 "
                           "loss 3079-4095 step 8 fsdp 3079-4095 step 8 tp 4088-4095 pp 1023-4095 step 1024 "
                           "same_params 3072-4095 stages [3, 7]")
    for role in ROLES:  # each role's groups split the world
        assert sorted(r for g in lay.groups(role) for r in g) == list(range(4096)), role


@pytest.mark.parametrize("cfg, world, local, words", [
    (ParallelConfig(tp=3), 8, 8, "world size 8 is not divisible by parallel.tp (3)"),
    (ParallelConfig(dp_replicate=3), 8, 8, "parallel.dp_replicate (3) does not divide the 8 data-parallel rank(s)"),
    (ParallelConfig(ep=4), 6, 6, "parallel.ep (4) does not divide the 6 data-parallel shard rank(s)"),
    (ParallelConfig(ep=3, cp=2), 4, 4, "parallel.ep (3) does not divide the 2 data-parallel shard rank(s) (world "
                                       "size 4 / (dp_replicate 1 x cp 2 x tp 1)) that expert parallelism splits, nor "
                                       "is it parallel.cp (2) times a divisor of them"),
    (ParallelConfig(tp=4), 8, 2, "parallel.tp (4) does not divide the 2 process(es) of this node"),
])
def test_a_layout_that_does_not_split_the_ranks_is_refused_naming_the_numbers(cfg, world, local, words):
    with pytest.raises(SetupError, match=words.replace("(", r"\(").replace(")", r"\)")):
        Layout.of(cfg, world).check(local)


@pytest.mark.parametrize("pp, tp, world, local, replicate", [(2, 1, 16, 8, None), (4, 8, 32, 8, None), (2, 1, 32, 8, 2)])
def test_the_notice_on_shard_groups_across_nodes_counts_one_pipeline_stage_and_its_remedy_passes(
        pp, tp, world, local, replicate):
    note = Layout.of(ParallelConfig(pp=pp, tp=tp), world).shard_group_note(local)
    assert bool(note) == (replicate is not None), note
    if replicate:  # each stage's 16 ranks span 2 nodes: 2 replicas keep each shard group in one
        assert f"--parallel.dp_replicate {replicate} (the nodes each pipeline stage spans)" in note
        fixed = Layout.of(ParallelConfig(pp=pp, tp=tp, dp_replicate=replicate), world)
        fixed.check(local)
        assert fixed.shard_group_note(local) == ""


def test_a_layout_refuses_degrees_below_one_ranks_outside_the_world_and_unknown_roles():
    for bad in (lambda: Layout(0), lambda: Layout(4, tp=-1), lambda: Layout(4, pp=0)):
        with pytest.raises(ValueError, match="integers >= 1"):
            bad()
    with pytest.raises(ValueError, match="rank 5 is not one of the 4 ranks"):
        Layout(4).members("data", 5)
    with pytest.raises(KeyError, match="the roles are data, loss"):
        Layout(4).size("dp")


def test_the_ep_sizes_offered_also_divide_the_experts():
    with pytest.raises(SetupError, match=r"use parallel.ep in \[1, 2\] "):  # 4 divides the shard ranks, not 6 experts
        Layout.of(ParallelConfig(ep=3), 4).check(4, n_experts=6)
