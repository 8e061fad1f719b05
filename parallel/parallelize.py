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

import functools

import torch
import torch.distributed as dist
from torch.distributed._composable import checkpoint as activation_checkpoint
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, create_selective_checkpoint_contexts

from model import ModelArgs, Transformer
from nn.moe import MoE, moe_layers
from parallel import float8
from parallel.context_parallel import apply_ulysses
from parallel.expert_parallel import apply_expert_parallel, shard_experts
from parallel.layout import Mesh, ParallelConfig
from parallel.moe_sequence import local_tokens, split_sequences
from parallel.pipeline_stages import ZERO_BUBBLE, PassThrough, prune, rank_stages, stage_modules, stages_per_rank

TPPlan = dict[str, ParallelStyle]
"""A tensor-parallel plan: module name pattern (e.g. 'layers.*.attention.wq') -> its style."""


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


def parallelize(model: Transformer, mesh: Mesh, cfg: ParallelConfig, *, dtype: str = "float32",
                activation_checkpointing: str = "none", compile: bool = False, tp_plan: TPPlan | None = None,
                float8_recipe: str = "off") -> None:
    """Apply the TP plan (when the layout has TP), float8, activation checkpointing, compile and FSDP2 to a meta-device model.

    dtype: 'bfloat16' (mixed precision: bf16 compute, fp32 master weights and gradient
    reductions) or 'float32'. activation_checkpointing: 'none', 'full' or 'selective' (keep
    matmul outputs). float8_recipe: train.float8, 'off', 'tensorwise' or 'rowwise' (see
    float8.py; needs torchao, and tp 1: config.validate refuses the rest). FSDP2 shards over
    mesh.fsdp (the data-parallel ranks with the CP ranks joined; under HSDP it replicates over
    the replicas), the routed experts under EP over mesh.experts_fsdp; CP swaps each attention
    kernel for Ulysses'.
    """
    if mesh.tp is not None:
        # src_data_rank=None: nothing is copied; init_weights fills the shards afterwards.
        parallelize_module(model, mesh.tp, plan_for(tp_plan, model), src_data_rank=None)
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
            moe = len(moe_layers(model))
            print(float8.describe(float8_recipe, kept, moe), flush=True)
    if mesh.cp is not None:
        apply_ulysses(model, mesh.cp)
    split_sequences(model, [m for m in (mesh.cp, mesh.tp) if m is not None])
    if mesh.ep is not None:
        apply_expert_parallel(model, mesh.ep, mesh.size("tp") if "tp" in mesh.layout.ep_takes else 1)
    if compile and mesh.tp is not None and getattr(model, "tok_embeddings", None) is not None:
        # Under TP the embedding's output is an AsyncCollectiveTensor (its reduce-scatter to sequence shards still in
        # flight), and a compiled first block given one returns no gradient for it: the embedding never trained
        # (torch 2.13, CPU; its AdamW moment stayed 0). A clone waits for it and hands the block a plain tensor.
        model.tok_embeddings.register_forward_hook(_plain_output)
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
    zero_bubble = mesh.pp is not None and cfg.pp_schedule in ZERO_BUBBLE
    kwargs = dict(mesh=mesh.fsdp, reshard_after_forward=cfg.reshard_after_forward and not zero_bubble,
                  offload_policy=CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy())
    if dtype == "bfloat16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if mesh.ep is not None:  # before the blocks, which then leave the experts to their own group
        shard_experts(model, **{**kwargs, "mesh": mesh.experts_fsdp})
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


def _plain_output(module: torch.nn.Module, args, output: torch.Tensor) -> torch.Tensor:
    """A forward hook's replacement output: a plain tensor (an AsyncCollectiveTensor waited for), with autograd."""
    return output.clone()


def stage_blocks(model: Transformer) -> list[torch.nn.Module]:
    """The blocks this rank runs: all of them, or under pipeline parallelism its stage's (pipeline.prune)."""
    return [b for b in model.layers if not isinstance(b, PassThrough)]


def plan_for(plan: TPPlan, model: Transformer) -> TPPlan:
    """plan as it applies to model: its "layers.*" entries written out for each block the model holds (a pipeline
    stage's, pipeline_stages.prune), its other entries for the modules it holds, and each MoE block's
    feed-forward run on this rank's share of the sequence (moe_sequence.local_tokens: the router and experts as
    plain tensors, which FSDP2 shards over the data-parallel ranks; their gradients are summed over TP after the
    backward, parallel/hooks.MoEHook).
    """
    out = {k: v for k, v in plan.items() if not k.startswith("layers.*.") and getattr(model, k.split(".")[0]) is not None}
    for i, block in enumerate(model.layers):
        if isinstance(block, PassThrough):
            continue
        moe = isinstance(block.feed_forward, MoE)
        out.update({k.replace("layers.*.", f"layers.{i}.", 1): v for k, v in plan.items()
                    if k.startswith("layers.*.") and not (moe and k.startswith("layers.*.feed_forward"))})
        if moe:
            out[f"layers.{i}.feed_forward"] = local_tokens()
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


def build_model(args: ModelArgs, mesh: Mesh, device: torch.device, seed: int, cfg: ParallelConfig, *,
                dtype: str = "float32", activation_checkpointing: str = "none", compile: bool = False,
                tp_plan: TPPlan | None = None, float8_recipe: str = "off") -> Transformer:
    """A Transformer of shape args, built on the meta device, parallelized on mesh and initialised from seed.

    The whole construction order in one call (see parallelize for the options). The weights
    equal those of a single-process Transformer(args).init_weights(seed) at any mesh.
    """
    with torch.device("meta"):
        model = Transformer(args)
    if mesh.pp is not None:
        pp, v = mesh.pp.size(), stages_per_rank(cfg.pp_schedule, cfg.pp_stages_per_rank)
        prune(model, rank_stages(mesh.pp.get_local_rank(), pp, v, cfg.pp_schedule), pp * v)
    parallelize(model, mesh, cfg, dtype=dtype, activation_checkpointing=activation_checkpointing,
                compile=compile, tp_plan=tp_plan, float8_recipe=float8_recipe)
    materialize(model, device, seed, cfg.cpu_offload)
    return model


def build_model_of(cfg, mesh: Mesh, device: torch.device, dtype: str, tp_plan: TPPlan | None = None) -> Transformer:
    """build_model with a config.Config's settings (duck-typed: this module sits below config.py): cfg.model's shape,
    train.seed, cfg.parallel, dtype (config.compute_dtype's), train's checkpointing, compile and float8."""
    t = cfg.train
    return build_model(cfg.model, mesh, device, t.seed, cfg.parallel, dtype=dtype,
                       activation_checkpointing=t.activation_checkpointing, compile=t.compile, tp_plan=tp_plan,
                       float8_recipe=t.float8)
