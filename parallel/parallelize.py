"""Parallelism, applied from outside in one place: the mesh, then TP, AC, compile, FSDP2, init.

Order (each step needs the one before):
build on the meta device -> tensor-parallel plan (2D only) -> float8 Linear layers (train.float8) ->
Ulysses attention (parallel.cp > 1, context_parallel.py) -> activation checkpointing -> compile ->
``fully_shard`` each block, then the root -> ``to_empty`` -> ``init_weights``.
TP first because FSDP2 shards the DTensors TP made; checkpointing and compile wrap the
blocks FSDP2 then shards as units; weights are initialised only once they exist on the
device, from the seed and the full shapes, so they do not depend on the layout. Module names
stay unchanged: composable activation checkpointing and ``Module.compile`` add no prefixes
to state-dict keys, so checkpoints load whatever the layout.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist
from torch.distributed._composable import checkpoint as activation_checkpoint
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleInputOutput, parallelize_module
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, create_selective_checkpoint_contexts

from core.errors import ConfigError, SetupError
from model import ModelArgs, Transformer
from nn.moe import MoE
from parallel import float8
from parallel.context_parallel import apply_ulysses
from parallel.expert_parallel import apply_expert_parallel, shard_experts
from parallel.pipeline_stages import ZERO_BUBBLE, PassThrough, prune, rank_stages, stage_modules, stages_per_rank

TPPlan = dict[str, ParallelStyle]
"""A tensor-parallel plan: module name pattern (e.g. 'layers.*.attention.wq') -> its style."""


@dataclasses.dataclass
class ParallelConfig:
    tp: int = 1
    """Tensor-parallel degree (train_2d.py only; train_fsdp.py needs 1)."""
    dp_replicate: int = 1
    """HSDP: data-parallel replicas; parameters are sharded over the world / (dp_replicate x tp) ranks of a replica and replicated across replicas (1: plain FSDP). Set it to the number of nodes to keep FSDP's all-gathers inside a node."""
    reshard_after_forward: bool = True
    """Free each block's gathered parameters after its forward (ZeRO-3); false keeps them until backward (ZeRO-2 like). The zero-bubble PP schedules keep them whatever this says (docs/pipeline.md)."""
    prefetch: int = 1
    """How many blocks ahead FSDP gathers parameters in forward and backward."""
    cpu_offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory (CUDA runs only)."""
    cp: int = 1
    """Context-parallel degree: each sequence is split into cp contiguous slices, one per rank of a CP group, with Ulysses attention (all-to-all of heads); FSDP shards over the data-parallel and CP ranks together. n_heads, n_kv_heads and seq_len must divide by cp (x tp). Both scripts."""

    ep: int = 1
    """Expert parallelism (model.n_experts > 0): each MoE layer's routed experts are split over ep ranks, tokens sent to them by all-to-all (expert_parallel.py). The ep ranks are data-parallel shard ranks (ep divides world / (dp_replicate x cp x tp)); the experts are FSDP-sharded over the ranks that hold the same ones. Both scripts; tp 1 and cp 1 (docs/moe.md)."""

    pp: int = 1
    """Pipeline-parallel stages (parallel/pipeline.py): the blocks split into pp contiguous stages, one per rank of a pipeline group, the outermost mesh dimension (so its point-to-point traffic is what crosses nodes). Both scripts; world = pp x data-parallel x cp x tp."""
    pp_schedule: str = "1F1B"
    """torch.distributed.pipelining's schedule by its name: 1F1B (the default: at most pp micro-batches' activations in flight), GPipe (all of them), Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble or DualPipeV (several stages per rank, a smaller bubble); docs/pipeline.md."""
    pp_stages_per_rank: int = 0
    """Stages each pipeline rank runs (the model is split into pp x this many): 0 means 1 for 1F1B and GPipe, 2 for the interleaved and V-shaped schedules (which need 2 or more; ZBVZeroBubble and DualPipeV exactly 2)."""
    pp_microbatches: int = 0
    """Micro-batches each data-parallel rank's share of the step is split into for the pipeline (>= pp, dividing that share); 0: the largest count the schedule takes that divides the share, up to 4 x pp. They replace train.micro_batch_size's gradient accumulation."""

    def data_parallel(self, world_size: int) -> int:
        """The data-parallel ranks of world_size processes: world / (pp x cp x tp) (HSDP's replicas included)."""
        return world_size // (self.tp * self.cp * self.pp)

    def __post_init__(self) -> None:
        if self.pp < 1:
            raise ConfigError(f"parallel.pp must be >= 1, got {self.pp}")
        if self.pp_stages_per_rank < 0:
            raise ConfigError(f"parallel.pp_stages_per_rank must be >= 0 (0: the schedule's default), got "
                              f"{self.pp_stages_per_rank}")
        if self.pp_microbatches < 0:
            raise ConfigError(f"parallel.pp_microbatches must be >= 0 (0: chosen from the batch), got {self.pp_microbatches}")
        if self.ep < 1:
            raise ConfigError(f"parallel.ep must be >= 1, got {self.ep}")
        if self.tp < 1:
            raise ConfigError(f"parallel.tp must be >= 1, got {self.tp}")
        if self.dp_replicate < 1:
            raise ConfigError(f"parallel.dp_replicate must be >= 1, got {self.dp_replicate}; use 1 (plain FSDP) or "
                              f"the number of nodes (HSDP)")
        if self.prefetch < 1:
            raise ConfigError(f"parallel.prefetch must be >= 1, got {self.prefetch}")
        if self.cp < 1:
            raise ConfigError(f"parallel.cp must be >= 1, got {self.cp}")


def check_layout(cfg: ParallelConfig, world_size: int, local_world_size: int) -> None:
    """The mesh's layout checks, before any collective: raises SetupError naming the numbers and the fix.

    world_size and local_world_size are torchrun's WORLD_SIZE and LOCAL_WORLD_SIZE (ranks of
    this node). The ranks must split into dp_replicate x dp_shard x cp x tp; a TP group (the
    ranks that communicate in every layer) must not span nodes, which with torchrun's
    node-by-node rank order means tp divides the ranks of a node.
    """
    tp, rep, cp, pp = cfg.tp, cfg.dp_replicate, cfg.cp, cfg.pp
    inner = tp * cp * pp
    if world_size % inner:
        parts = [f"parallel.{n}" for n, v in (("pp", pp), ("cp", cp), ("tp", tp)) if v > 1]
        what = " x ".join(parts) if parts else "parallel.tp"
        raise SetupError(f"world size {world_size} is not divisible by {what} ({inner}); launch a multiple of "
                         f"{inner} processes or change {what}")
    dp = cfg.data_parallel(world_size)
    if dp % rep:
        fix = f"use a divisor of {dp} (the number of nodes is usual)" if dp > 1 else "use parallel.dp_replicate 1"
        div = f"parallel.tp {tp}" if cp == 1 else f"(parallel.cp {cp} x parallel.tp {tp})"
        div = div if pp == 1 else f"(parallel.pp {pp} x {div})"
        raise SetupError(f"parallel.dp_replicate ({rep}) does not divide the {dp} data-parallel rank(s) (world size "
                         f"{world_size} / {div}); {fix} or launch a multiple of {rep * inner} processes")
    shard = dp // rep
    if shard % cfg.ep:
        fits = [d for d in range(1, shard + 1) if shard % d == 0]
        raise SetupError(f"parallel.ep ({cfg.ep}) does not divide the {shard} data-parallel shard rank(s) (world size "
                         f"{world_size} / (dp_replicate {rep} x cp {cp} x tp {tp}{f' x pp {pp}' if pp > 1 else ''})) "
                         f"that expert parallelism splits; use parallel.ep in {fits} or launch a multiple of "
                         f"{cfg.ep * rep * inner} processes")
    if local_world_size % tp:
        raise SetupError(f"parallel.tp ({tp}) does not divide the {local_world_size} process(es) of this node "
                         f"(LOCAL_WORLD_SIZE), so a TP group would span nodes; use a parallel.tp that divides "
                         f"--nproc_per_node")


def shard_group_note(cfg: ParallelConfig, world_size: int, local_world_size: int) -> str:
    """A notice when each FSDP shard group spans nodes (its all-gathers then cross the slow links), else ''."""
    group = world_size // cfg.dp_replicate  # dp_shard x cp x tp consecutive ranks
    if group <= local_world_size or world_size <= local_world_size:
        return ""
    # This rank sees only its own node's size; the node count is exact when every node runs as many ranks.
    nodes = f" {world_size // local_world_size}" if world_size % local_world_size == 0 else ""
    return (f"[train] notice: each FSDP shard group spans {group} ranks, more than the {local_world_size} of this "
            f"node, so parameters are all-gathered across nodes every step; --parallel.dp_replicate{nodes} (the "
            f"number of nodes) keeps them inside a node (HSDP)")


def build_mesh(device: torch.device, world_size: int, tp: int = 1, dp_replicate: int = 1, cp: int = 1,
               ep: int = 1, pp: int = 1) -> DeviceMesh:
    """The device mesh (collective), with a "dp" dimension over every data-parallel rank.

    ("dp",) of world_size, or ("dp", "tp") of (world_size / tp, tp) when tp > 1. With
    dp_replicate > 1 (HSDP) the data-parallel ranks split into ("dp_replicate", "dp_shard")
    (then "tp"), and dp_mesh(mesh) is those two flattened: the loader, validation and the loss
    scaling see one data-parallel group whatever the layout. With cp > 1 a "cp" dimension
    comes before "tp" (order: dp_replicate, dp_shard, cp, tp), and the flattened meshes
    fsdp_mesh and loss_mesh join it to the data-parallel ranks. Consecutive ranks form a TP
    group, then a CP group, then a shard group, so with torchrun's rank order (node by node)
    they stay inside a node when their sizes divide the node's ranks. The caller has checked
    that tp x cp x dp_replicate divides world_size. With ep > 1 the shard ranks ("dp", or
    "dp_shard" under HSDP) are two dimensions, ("dp_mod_ep", "ep"): consecutive ranks form an
    EP group, and the ranks that hold the same experts are "dp_mod_ep" (expert_mesh); the
    caller has checked that ep divides the shard ranks. With pp > 1 a "pp" dimension comes
    first (outermost: consecutive ranks share a stage, so the other groups stay inside a node
    and the pipeline's point-to-point traffic is what crosses nodes).
    """
    dp = world_size // (tp * cp * pp)
    shard = dp // dp_replicate
    if ep > 1:
        names, shape = ("dp_mod_ep", "ep"), (shard // ep, ep)
    else:
        names, shape = ("dp_shard" if dp_replicate > 1 else "dp",), (shard,)
    if dp_replicate > 1:
        names, shape = ("dp_replicate",) + names, (dp_replicate,) + shape
    if pp > 1:
        names, shape = ("pp",) + names, (pp,) + shape
    if cp > 1:
        names, shape = names + ("cp",), shape + (cp,)
    if tp > 1:
        names, shape = names + ("tp",), shape + (tp,)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    # The flattened groups are created now, while every rank is here.
    if ep > 1:
        mesh["dp_mod_ep", "ep"]._flatten("dp_shard" if dp_replicate > 1 else "dp")
    dp_mesh(mesh)
    fsdp_mesh(mesh)
    loss_mesh(mesh)
    stage_group(mesh)
    return mesh


def stage_group(mesh: DeviceMesh):
    """The process group of the ranks that hold the same parameters (a Muon step's, optimization/muon.py): None
    (every rank), or under pipeline parallelism this rank's stage's, every mesh dimension but "pp"."""
    names = mesh.mesh_dim_names or ()
    if "pp" not in names:
        return None
    rest = tuple(n for n in names if n != "pp")
    return (mesh[rest]._flatten("stage") if len(rest) > 1 else mesh[rest[0]]).get_group()


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh over every data-parallel rank: "dp", or with HSDP "dp_replicate" x "dp_shard" flattened.

    The loader's rank and size, validation's and the logged loss's reductions use it. The
    flattened mesh is created once (by build_mesh, collectively) and cached by DeviceMesh.
    """
    names = mesh.mesh_dim_names or ()
    if "dp_replicate" in names:
        return mesh[("dp_replicate",) + _shard_dims(names)]._flatten("dp")
    return mesh["dp"]  # with "ep": ("dp_mod_ep", "ep") flattened by build_mesh


def _shard_dims(names: tuple[str, ...]) -> tuple[str, ...]:
    """The mesh dimensions of the data-parallel shard ranks: ("dp_mod_ep", "ep") under EP, else "dp_shard" or "dp"."""
    if "ep" in names:
        return ("dp_mod_ep", "ep")
    return ("dp_shard",) if "dp_replicate" in names else ("dp",)


def expert_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh fully_shard takes for the routed experts under EP: the ranks that hold the same experts,
    "dp_mod_ep", with "dp_replicate" before it under HSDP."""
    names = mesh.mesh_dim_names or ()
    return mesh["dp_replicate", "dp_mod_ep"] if "dp_replicate" in names else mesh["dp_mod_ep"]


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh fully_shard takes: ("dp_replicate", "dp_shard") for HSDP (shard, then all-reduce across replicas), else ("dp",).

    With a "cp" dimension the shard dimension is the data-parallel shard ranks and the CP
    ranks flattened ("dp_shard_cp", torchtitan's name), so CP costs no parameter memory and
    each gradient is reduced over every rank that saw a part of the batch.
    """
    names = mesh.mesh_dim_names or ()
    shard = "dp_shard" if "dp_replicate" in names else "dp"
    if "cp" in names:
        flat = mesh[_shard_dims(names) + ("cp",)]._flatten("dp_shard_cp")
        if "dp_replicate" not in names:
            return flat
        shard = "dp_shard_cp"  # HSDP x CP: the 2-D (dp_replicate, dp_shard_cp) mesh, as torchtitan slices it
    if "dp_replicate" in names:
        return mesh["dp_replicate", shard]
    return mesh[shard]


def loss_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh over every rank that holds its own tokens: dp_mesh, with the CP ranks joined when there are.

    The step's loss sum and validation's sums are reduced over it, and its size is the count
    FSDP averages gradients over (forward_backward scales the loss by it).
    """
    names = mesh.mesh_dim_names or ()
    if "cp" not in names:
        return dp_mesh(mesh)
    if "dp_replicate" not in names:
        return fsdp_mesh(mesh)  # ("dp", "cp") flattened already
    return mesh[("dp_replicate",) + _shard_dims(names) + ("cp",)]._flatten("dp_cp")


def selective_policy(ctx, op, *args, **kwargs):
    """Keep matmul and attention outputs for backward, recompute the cheap elementwise rest."""
    keep = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten._scaled_dot_product_flash_attention.default,
            torch.ops.aten._scaled_dot_product_efficient_attention.default,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
            torch.ops.aten._scaled_mm.default)  # float8 matmuls (train.float8)
    return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE


PROFILER_OPS = (torch.ops.profiler._record_function_enter.default,
                torch.ops.profiler._record_function_enter_new.default,
                torch.ops.profiler._record_function_exit.default,
                torch.ops.profiler._record_function_exit._RecordFunction)
"""The profiler's annotation ops (record_function), which selective checkpointing must not count.

Selective checkpointing numbers every op of a block's forward and fails the recompute when an op
runs more often than it did then, whatever the policy returns for it. Under expert parallelism
the experts have their own fully_shard group, whose hooks run inside the block's checkpointed
region; in the recompute no forward is in progress, so that group takes itself for the forward's
root and adds an FSDP::root_pre_forward annotation the forward did not make (torchtitan's
DeepSeek-V3 hit the same, pytorch/torchtitan#3427). Annotations compute nothing, so leaving them
out of the count (as torch.utils.checkpoint already leaves out detach) changes no number."""


def parallelize(model: Transformer, mesh: DeviceMesh, cfg: ParallelConfig, *, dtype: str = "float32",
                activation_checkpointing: str = "none", compile: bool = False, tp_plan: TPPlan | None = None,
                float8_recipe: str = "off") -> None:
    """Apply the TP plan (when mesh has "tp"), float8, activation checkpointing, compile and FSDP2 to a meta-device model.

    dtype: 'bfloat16' (mixed precision: bf16 compute, fp32 master weights and gradient
    reductions) or 'float32'. activation_checkpointing: 'none', 'full' or 'selective' (keep
    matmul outputs). float8_recipe: train.float8, 'off', 'tensorwise' or 'rowwise' (see
    float8.py; needs torchao, and tp 1: config.validate refuses the rest). FSDP2 shards over
    the mesh's "dp" dimension, or with HSDP over "dp_shard" and replicates over "dp_replicate",
    with the "cp" ranks joined to the shard dimension (see fsdp_mesh); a "cp" dimension swaps
    each attention kernel for Ulysses'.
    """
    names = mesh.mesh_dim_names or ()
    if "tp" in names:
        # src_data_rank=None: nothing is copied; init_weights fills the shards afterwards.
        parallelize_module(model, mesh["tp"], plan_for(tp_plan, model), src_data_rank=None)
    if float8_recipe != "off":
        # Float8 swaps the blocks' Linear modules, so it comes before everything that wraps or
        # traces them: activation checkpointing must recompute the float8 casts (and the
        # selective policy keep _scaled_mm's outputs), compile must see them to fuse each cast
        # into its neighbours (most of float8's speed), and fully_shard must find torchao's
        # weight subclass to all-gather float8 bytes (tensorwise). After TP in this order;
        # float8 under TP is refused (float8.check): torchao's Float8ColwiseParallel styles
        # would have to replace train_2d.py's plan.
        kept = float8.convert(model, float8_recipe)
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(float8.describe(float8_recipe, kept), flush=True)
    if "cp" in names:
        apply_ulysses(model, mesh["cp"])
    if "ep" in names:
        apply_expert_parallel(model, mesh["ep"])
    for block in stage_blocks(model):
        if activation_checkpointing == "full":
            activation_checkpoint(block)
        elif activation_checkpointing == "selective":
            SAC_IGNORED_OPS.update(PROFILER_OPS)
            activation_checkpoint(block, context_fn=functools.partial(create_selective_checkpoint_contexts,
                                                                      selective_policy))
        if compile:
            block.compile()
    # A zero-bubble schedule's weight-gradient pass finds the parameters the forward used by the stage's parameters():
    # resharded after the forward, those are the shards, not the gathered tensors in the graph, and the weight
    # gradients that pass should give are lost. So their stages keep the parameters gathered until the step's
    # gradient reduction (as torchtitan keeps them under any PP schedule).
    zero_bubble = "pp" in names and cfg.pp_schedule in ZERO_BUBBLE
    kwargs = dict(mesh=fsdp_mesh(mesh), reshard_after_forward=cfg.reshard_after_forward and not zero_bubble,
                  offload_policy=CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy())
    if dtype == "bfloat16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if "ep" in names:  # before the blocks, which then leave the experts to their own group
        shard_experts(model, **{**kwargs, "mesh": expert_mesh(mesh)})
    # Each pipeline stage is its own FSDP root (the model itself, without PP or with one stage per rank).
    for _, root in stage_modules(model):
        blocks = stage_blocks(root)
        for block in blocks:
            fully_shard(block, **kwargs)
        fully_shard(root, **kwargs)
        if cfg.prefetch > 1:  # depth 1 is FSDP2's implicit prefetch
            for i, block in enumerate(blocks):
                block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + cfg.prefetch])
                block.set_modules_to_backward_prefetch(blocks[max(0, i - cfg.prefetch):i][::-1])


def stage_blocks(model: Transformer) -> list[torch.nn.Module]:
    """The blocks this rank runs: all of them, or under pipeline parallelism its stage's (pipeline.prune)."""
    return [b for b in model.layers if not isinstance(b, PassThrough)]


def plan_for(plan: TPPlan, model: Transformer) -> TPPlan:
    """plan as it applies to model: its "layers.*" entries written out for each block the model holds (a pipeline
    stage's, pipeline_stages.prune), its other entries for the modules it holds, and each MoE block's
    feed-forward computed whole on every TP rank of its group.

    The MoE's input, sharded on the sequence between blocks, is all-gathered over TP, the router
    and experts run unsplit as plain tensors (FSDP2 shards them over the data-parallel ranks
    only; each TP rank computes the same gradient), and the output is sliced back to this
    rank's part of the sequence. Exact, at the cost of repeating the MoE's compute tp times
    (docs/moe.md).
    """
    out = {k: v for k, v in plan.items() if not k.startswith("layers.*.") and getattr(model, k.split(".")[0]) is not None}
    for i, block in enumerate(model.layers):
        if isinstance(block, PassThrough):
            continue
        moe = isinstance(block.feed_forward, MoE)
        out.update({k.replace("layers.*.", f"layers.{i}.", 1): v for k, v in plan.items()
                    if k.startswith("layers.*.") and not (moe and k.startswith("layers.*.feed_forward"))})
        if moe:
            out[f"layers.{i}.feed_forward"] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
                output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True)
    return out


def copy_sharded(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write a full initial value into a (possibly DTensor) parameter, keeping only the local shard.

    distribute_tensor with src_data_rank=None slices locally: no communication, and the
    result is the same whatever the mesh, so initial weights do not depend on sharding.
    """
    if isinstance(param, DTensor):
        full = distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
    param.copy_(full)


def materialize(model: Transformer, device: torch.device, seed: int, cpu_offload: bool = False) -> None:
    """to_empty onto device (parameters on CPU when offloading), then init_weights(seed), shard by shard."""
    model.to_empty(device="cpu" if cpu_offload else device)
    for module in model.modules():  # buffers (RoPE, MoE biases) are not offloaded: compute needs them on the device
        for name, buf in module.named_buffers(recurse=False):
            setattr(module, name, buf.to(device))
    model.init_weights(seed, copy_=copy_sharded)


def build_model(args: ModelArgs, mesh: DeviceMesh, device: torch.device, seed: int, cfg: ParallelConfig, *,
                dtype: str = "float32", activation_checkpointing: str = "none", compile: bool = False,
                tp_plan: TPPlan | None = None, float8_recipe: str = "off") -> Transformer:
    """A Transformer of shape args, built on the meta device, parallelized on mesh and initialised from seed.

    The whole construction order in one call (see parallelize for the options). The weights
    equal those of a single-process Transformer(args).init_weights(seed) at any mesh.
    """
    with torch.device("meta"):
        model = Transformer(args)
    if "pp" in (mesh.mesh_dim_names or ()):
        pp, v = mesh["pp"].size(), stages_per_rank(cfg.pp_schedule, cfg.pp_stages_per_rank)
        prune(model, rank_stages(mesh["pp"].get_local_rank(), pp, v, cfg.pp_schedule), pp * v)
    parallelize(model, mesh, cfg, dtype=dtype, activation_checkpointing=activation_checkpointing,
                compile=compile, tp_plan=tp_plan, float8_recipe=float8_recipe)
    materialize(model, device, seed, cfg.cpu_offload)
    return model
