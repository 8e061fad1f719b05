"""The layout: which rank does what, computed from ParallelConfig and the world size, and the one owner of the mesh.

A ``Layout`` needs no process group: its ``check`` holds the size rules, and ``coords`` and
``members`` say, for any rank of any world size, where it sits and which ranks it shares each
group with. ``build`` is the only place that creates and flattens ``DeviceMesh``es; the
``Mesh`` it returns hands out each group by its role, and no other module reads mesh
dimension names.

The dimensions, outermost first (consecutive ranks share the innermost): "pp", "dp_replicate",
the data-parallel shard ranks ("dp", or "dp_shard" under HSDP, split into "dp_mod_ep" x "ep"
under expert parallelism, or "dp_mod_ep" x "dp_in_ep" when EP takes in the CP or TP ranks), "cp",
"tp". With torchrun's rank order (node by node) a TP group, then a CP group, then a shard group
stay inside a node when their sizes divide the node's ranks, and the pipeline's point-to-point
traffic is what crosses nodes. The names are torchtitan's.

The roles (``ROLES``):
  data         every data-parallel rank: the loader's split, HSDP's replicas included
  loss         the ranks that hold their own tokens: data x cp; losses are summed and FSDP
               averages gradients over it
  fsdp         what fully_shard shards over (data x cp; 2-D (replicate, shard x cp) under HSDP)
  experts_fsdp what fully_shard shards the routed experts over under EP: the ranks that hold the
               same experts and their own tokens (replicate x dp_mod_ep, x cp unless EP takes the CP
               ranks; TP ranks hold the same shards and sum their gradients after the backward,
               parallel/moe_sequence.py, unless EP takes them in)
  ep           the expert-parallel group: "ep" data-parallel shard ranks, or, where parallel.ep does
               not divide them, some of them ("dp_in_ep") times the CP ranks (torchtitan's
               grouping), or times the CP and TP ranks (Layout.ep_takes): every rank of it holds
               its own tokens
  cp, tp       the context- and tensor-parallel groups
  pp           the pipeline: one rank per stage
  same_params  the ranks that hold the same parameters: everything but the pipeline
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from core.errors import ConfigError, SetupError
from parallel.pipeline_stages import rank_stages, stages_per_rank


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
    """Expert parallelism (model.n_experts > 0): each MoE layer's routed experts are split over ep ranks, tokens sent to them by all-to-all (expert_parallel.py). The ep ranks are data-parallel shard ranks (ep divides world / (pp x dp_replicate x cp x tp)), or, where those are too few, ep / cp of them times the CP ranks (ep a multiple of cp), or ep / (cp x tp) of them times the CP and TP ranks, each exchanging its own tokens (its share of the sequence under tp and cp); the experts are FSDP-sharded over the ranks that hold the same ones. Both scripts, with tp and cp (docs/moe.md)."""

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


def ep_takes_options(cp: int = 1, tp: int = 1) -> list[tuple[tuple[str, ...], int]]:
    """[(mesh dimensions an EP group takes in besides data-parallel shard ranks, their ranks)], in the order EP tries
    them: none, then the CP ranks, then the CP and TP ranks (every rank of each holds its own tokens)."""
    out = [((), 1)]
    if cp > 1:
        out.append((("cp",), cp))
    if tp > 1:
        out.append((("cp", "tp") if cp > 1 else ("tp",), cp * tp))
    return out


def ep_sizes(shard: int, cp: int = 1, tp: int = 1, n_experts: int = 0) -> list[int]:
    """The parallel.ep values that fit shard data-parallel shard ranks (Layout.dp_shard) at parallel.cp cp and
    parallel.tp tp, ascending: the divisors of shard, and their multiples by cp, cp x tp (ep_takes_options), that
    also divide n_experts. shard 0 (unknown): every divisor of n_experts; n_experts 0 (dense): no such limit."""
    if shard:
        divisors = [d for d in range(1, shard + 1) if shard % d == 0]
        sizes = sorted({d * m for d in divisors for _, m in ep_takes_options(cp, tp)})
    else:
        sizes = range(1, n_experts + 1)
    return [d for d in sizes if not n_experts or n_experts % d == 0]


ROLES = ("data", "loss", "fsdp", "experts_fsdp", "ep", "cp", "tp", "pp", "same_params")
"""The groups a Layout knows by role (the module docstring says what each is)."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """How world_size ranks split into pp x dp_replicate x dp_shard x cp x tp (dp_shard = dp_mod_ep x ep, or
    dp_mod_ep x dp_in_ep when EP takes in the CP or TP ranks: ep_takes)."""

    world_size: int
    pp: int = 1
    dp_replicate: int = 1
    ep: int = 1
    cp: int = 1
    tp: int = 1
    pp_schedule: str = "1F1B"
    pp_stages_per_rank: int = 0

    def __post_init__(self) -> None:
        bad = [f"{k} {getattr(self, k)!r}" for k in ("world_size", "pp", "dp_replicate", "ep", "cp", "tp")
               if not isinstance(getattr(self, k), int) or isinstance(getattr(self, k), bool) or getattr(self, k) < 1]
        if bad:
            raise ValueError(f"a Layout's world size and degrees are integers >= 1; got {', '.join(bad)}")

    @classmethod
    def of(cls, cfg: ParallelConfig, world_size: int) -> Layout:
        """The layout of cfg's degrees over world_size ranks (not checked: see check)."""
        return cls(world_size, cfg.pp, cfg.dp_replicate, cfg.ep, cfg.cp, cfg.tp, cfg.pp_schedule,
                   cfg.pp_stages_per_rank)

    @property
    def data(self) -> int:
        """Data-parallel ranks: world / (pp x cp x tp), HSDP's replicas included."""
        return self.world_size // (self.pp * self.cp * self.tp)

    @property
    def dp_shard(self) -> int:
        """Data-parallel ranks of one HSDP replica (all of them without HSDP); EP splits these."""
        return self.data // self.dp_replicate

    @property
    def ep_takes(self) -> tuple[str, ...]:
        """The mesh dimensions each EP group takes in besides data-parallel shard ranks: () while parallel.ep
        divides those; else ("cp",) where ep / cp does, then ("cp", "tp") (or ("tp",) without CP) where
        ep / (cp x tp) does: the first of ep_takes_options that fits. torchtitan's EP always spans the CP ranks
        and never the TP ones (its experts see the TP ranks' tokens repeated); here every TP rank routes its own
        tokens (moe_sequence.py), and the data-parallel ranks come first, so that a layout that ran before keeps
        its groups, and a run its bitwise resume. () too when nothing fits (check refuses it)."""
        for dims, ranks in ep_takes_options(self.cp, self.tp) if self.ep > 1 else ():
            if self.ep % ranks == 0 and self.dp_shard % (self.ep // ranks) == 0:
                return dims
        return ()

    @property
    def ep_shard(self) -> int:
        """The data-parallel shard ranks in an EP group: ep over the ranks of the dimensions it takes in."""
        sizes = {"cp": self.cp, "tp": self.tp}
        return self.ep // math.prod(sizes[d] for d in self.ep_takes)

    def dims(self) -> tuple[tuple[str, int], ...]:
        """((mesh dimension name, size), ...) outermost first; a dimension of size 1 is left out, but for the
        data-parallel shard ranks, which are always there."""
        inner = "dp_in_ep" if self.ep_takes else "ep"
        shard = ((("dp_mod_ep", self.dp_shard // self.ep_shard), (inner, self.ep_shard)) if self.ep > 1 else
                 ((("dp_shard" if self.dp_replicate > 1 else "dp"), self.dp_shard),))
        out = ((("pp", self.pp),) if self.pp > 1 else ()) + (
            (("dp_replicate", self.dp_replicate),) if self.dp_replicate > 1 else ()) + shard
        return out + ((("cp", self.cp),) if self.cp > 1 else ()) + ((("tp", self.tp),) if self.tp > 1 else ())

    def role_dims(self, role: str) -> tuple[str, ...]:
        """The mesh dimensions a role's group spans (() when the layout has no such group). Raises KeyError for a
        role not in ROLES."""
        if role not in ROLES:
            raise KeyError(f"{role!r} is not a role; the roles are {', '.join(ROLES)}")
        names = [n for n, _ in self.dims()]
        shard = [n for n in names if n in ("dp", "dp_shard", "dp_mod_ep", "ep", "dp_in_ep")]
        rep = ["dp_replicate"] if self.dp_replicate > 1 else []
        cp = ["cp"] if self.cp > 1 else []
        ep = (["dp_in_ep", *self.ep_takes] if self.ep_takes else ["ep"]) if self.ep > 1 else []
        spans = {"data": rep + shard, "loss": rep + shard + cp, "fsdp": rep + shard + cp,
                 "experts_fsdp": rep + ["dp_mod_ep"] + ([] if "cp" in self.ep_takes else cp) if self.ep > 1 else [],
                 "ep": ep, "cp": cp, "tp": ["tp"] if self.tp > 1 else [],
                 "pp": ["pp"] if self.pp > 1 else [], "same_params": [n for n in names if n != "pp"]}
        return tuple(spans[role])

    def size(self, role: str) -> int:
        """The number of ranks in each of role's groups (1 when the layout has none)."""
        sizes = dict(self.dims())
        return math.prod(sizes[n] for n in self.role_dims(role))

    def coords(self, rank: int) -> dict[str, int]:
        """{mesh dimension name: rank's index along it}: row-major, as init_device_mesh lays out the ranks. Raises
        ValueError for a rank outside [0, world_size)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not one of the {self.world_size} ranks (0 to {self.world_size - 1})")
        out = {}
        for name, size in reversed(self.dims()):
            rank, out[name] = divmod(rank, size)
        return dict(reversed(out.items()))

    def members(self, role: str, rank: int) -> list[int]:
        """The ranks, ascending, of rank's group of role: those whose coordinates differ only along its
        dimensions ([rank] when the layout has no such group)."""
        span, mine, ranks = self.role_dims(role), self.coords(rank), [0]
        for name, size in self.dims():  # row-major: outermost first
            ranks = [r * size + c for r in ranks for c in (range(size) if name in span else (mine[name],))]
        return ranks

    def groups(self, role: str) -> list[list[int]]:
        """Every group of role, each ascending, ordered by its first rank."""
        span = self.role_dims(role)
        return [self.members(role, r) for r in range(self.world_size)
                if all(v == 0 for n, v in self.coords(r).items() if n in span)]

    def stages(self, rank: int) -> list[int]:
        """The pipeline stages rank runs ([0] without pipeline parallelism; pipeline_stages.rank_stages)."""
        if self.pp == 1:
            return [0]
        v = stages_per_rank(self.pp_schedule, self.pp_stages_per_rank)
        return rank_stages(self.coords(rank)["pp"], self.pp, v, self.pp_schedule)

    def experts(self, rank: int, n_experts: int) -> range:
        """The routed experts rank holds of n_experts (all of them without expert parallelism): EP rank r (its
        index in its EP group) holds the r-th contiguous n_experts / ep (expert_parallel.py)."""
        per = n_experts // self.ep
        r = self.members("ep", rank).index(rank)
        return range(r * per, (r + 1) * per)

    def describe(self, rank: int, n_experts: int = 0) -> str:
        """One line on rank: its coordinates, each role's group, its stages and (n_experts > 0) its experts."""
        groups = " ".join(f"{role} {_ranks(self.members(role, rank))}" for role in ROLES if self.role_dims(role))
        experts = self.experts(rank, n_experts) if n_experts else None
        return (f"rank {rank} {self.coords(rank)} {groups} stages {self.stages(rank)}"
                + (f" experts {experts.start}-{experts.stop - 1}" if experts is not None else ""))

    def table(self, n_experts: int = 0) -> list[str]:
        """describe(rank) of every rank: the whole layout, computed without starting anything."""
        return [self.describe(r, n_experts) for r in range(self.world_size)]

    def check(self, local_world_size: int | None = None, n_experts: int = 0) -> None:
        """The size rules, before any collective: raises SetupError naming the numbers and the fix.

        local_world_size: torchrun's LOCAL_WORLD_SIZE (ranks of this node; None: the world's).
        n_experts: model.n_experts (0: dense), which the ep sizes offered must also divide. The
        ranks must split into pp x dp_replicate x dp_shard x cp x tp, ep must divide dp_shard (or, a
        multiple of cp or cp x tp, ep over it must: ep_takes), and
        a TP group (the ranks that communicate in every layer) must not span nodes, which with
        torchrun's node-by-node rank order means tp divides the ranks of a node.
        """
        world, tp, rep, cp, pp = self.world_size, self.tp, self.dp_replicate, self.cp, self.pp
        local = world if local_world_size is None else local_world_size
        inner = tp * cp * pp
        if world % inner:
            parts = [f"parallel.{n}" for n, v in (("pp", pp), ("cp", cp), ("tp", tp)) if v > 1]
            what = " x ".join(parts) if parts else "parallel.tp"
            raise SetupError(f"world size {world} is not divisible by {what} ({inner}); launch a multiple of "
                             f"{inner} processes or change {what}")
        dp = self.data
        if dp % rep:
            fix = f"use a divisor of {dp} (the number of nodes is usual)" if dp > 1 else "use parallel.dp_replicate 1"
            div = f"parallel.tp {tp}" if cp == 1 else f"(parallel.cp {cp} x parallel.tp {tp})"
            div = div if pp == 1 else f"(parallel.pp {pp} x {div})"
            raise SetupError(f"parallel.dp_replicate ({rep}) does not divide the {dp} data-parallel rank(s) (world "
                             f"size {world} / {div}); {fix} or launch a multiple of {rep * inner} processes")
        shard = dp // rep
        if shard % self.ep_shard:
            fits = ep_sizes(shard, cp, tp, n_experts)
            times = " or ".join(f"{' x '.join(f'parallel.{d}' for d in dims)} ({m})"
                                for dims, m in ep_takes_options(cp, tp)[1:])
            nor = f", nor is it {times} times a divisor of them (EP then takes in those ranks)" if times else ""
            least = min(self.ep // m for _, m in ep_takes_options(cp, tp) if self.ep % m == 0)
            raise SetupError(f"parallel.ep ({self.ep}) does not divide the {shard} data-parallel shard rank(s) (world "
                             f"size {world} / (dp_replicate {rep} x cp {cp} x tp {tp}{f' x pp {pp}' if pp > 1 else ''}"
                             f")) that expert parallelism splits{nor}; use parallel.ep in {fits} or launch a multiple "
                             f"of {least * rep * inner} processes")
        if local % tp:
            raise SetupError(f"parallel.tp ({tp}) does not divide the {local} process(es) of this node "
                             f"(LOCAL_WORLD_SIZE), so a TP group would span nodes; use a parallel.tp that divides "
                             f"--nproc_per_node")

    def shard_group_note(self, local_world_size: int) -> str:
        """A notice when each FSDP shard group spans nodes (its all-gathers then cross the slow links), else ''."""
        group = self.world_size // (self.dp_replicate * self.pp)  # dp_shard x cp x tp consecutive ranks
        if group <= local_world_size or self.world_size <= local_world_size:
            return ""
        # This rank sees only its own node's size; the node count is exact when every node runs as many ranks. A
        # pipeline stage's ranks are a pp-th of them (the outermost dimension), so its replicas are its nodes.
        per_stage = local_world_size * self.pp
        nodes = self.world_size // per_stage if self.world_size % per_stage == 0 else 0
        what = "the number of nodes" if self.pp == 1 else "the nodes each pipeline stage spans"
        if nodes and self.data % nodes:  # CP x TP alone span the nodes: HSDP has no replicas to make
            fix = "a parallel.cp x parallel.tp that fits in a node would keep them inside one"
        else:
            fix = f"--parallel.dp_replicate{f' {nodes}' if nodes else ''} ({what}) keeps them inside a node (HSDP)"
        return (f"[train] notice: each FSDP shard group spans {group} ranks, more than the {local_world_size} of "
                f"this node, so parameters are all-gathered across nodes every step; {fix}")

    def build(self, device: torch.device | str) -> Mesh:
        """The device mesh and every role's group (collective: every rank calls it, in the same order)."""
        names, shape = zip(*self.dims())
        mesh = init_device_mesh(torch.device(device).type, shape, mesh_dim_names=names)

        def flat(dims: tuple[str, ...], name: str) -> DeviceMesh:
            return mesh[dims]._flatten(name) if len(dims) > 1 else mesh[dims[0]]

        def sub(role: str) -> DeviceMesh | None:
            dims = self.role_dims(role)
            return mesh[dims if len(dims) > 1 else dims[0]] if dims else None

        # The flattened meshes, created now, while every rank is here, in this order (DeviceMesh caches them).
        rep = ("dp_replicate",) if self.dp_replicate > 1 else ()
        shard_dims, shard_name = self.role_dims("data")[len(rep):], "dp_shard" if rep else "dp"
        shard = flat(shard_dims, shard_name)  # ("dp_mod_ep", "ep") flattened under EP
        data = flat(rep + shard_dims, "dp") if rep else shard
        fsdp = mesh[rep + (shard_name,)] if rep else shard
        loss = data
        if self.cp > 1:  # the CP ranks join the shard dimension ("dp_shard_cp", torchtitan's name)
            shard_cp = flat(shard_dims + ("cp",), "dp_shard_cp")
            fsdp = mesh[rep + ("dp_shard_cp",)] if rep else shard_cp
            loss = flat(rep + shard_dims + ("cp",), "dp_cp") if rep else shard_cp
        # Where EP takes in other dimensions, its group is dp_in_ep x those, one flat dimension for the all-to-all.
        ep = flat(self.role_dims("ep"), "ep") if self.ep_takes else sub("ep")
        experts_fsdp = None
        if self.ep > 1:  # dp_mod_ep, with the CP ranks joined unless EP takes them, as the shard dimension has them
            joined = self.cp > 1 and "cp" not in self.ep_takes
            inner, inner_name = (flat(("dp_mod_ep", "cp"), "dp_mod_ep_cp"), "dp_mod_ep_cp") if joined else (
                mesh["dp_mod_ep"], "dp_mod_ep")
            experts_fsdp = mesh[rep + (inner_name,)] if rep else inner
        same = self.role_dims("same_params")
        same_params = flat(same, "stage").get_group() if self.pp > 1 else None
        return Mesh(self, mesh, data=data, loss=loss, fsdp=fsdp, experts_fsdp=experts_fsdp, ep=ep,
                    cp=sub("cp"), tp=sub("tp"), pp=sub("pp"), same_params=same_params)


def _ranks(ranks: list[int]) -> str:
    """A group's ranks in a few characters: [4, 5], or 0-7, or 0-56 step 8 (an arithmetic run of 3 or more)."""
    step = ranks[1] - ranks[0] if len(ranks) > 2 else 0
    if step and all(b - a == step for a, b in zip(ranks, ranks[1:])):
        return f"{ranks[0]}-{ranks[-1]}" + (f" step {step}" if step > 1 else "")
    return str(ranks)


@dataclasses.dataclass
class Mesh:
    """A built Layout: the device mesh, and each role's DeviceMesh (None where the layout has no such group)."""

    layout: Layout
    device_mesh: DeviceMesh
    data: DeviceMesh
    """1-D, every data-parallel rank (the loader's rank and size)."""
    loss: DeviceMesh
    """1-D, data x cp: the ranks holding their own tokens (loss sums; FSDP averages gradients over them)."""
    fsdp: DeviceMesh
    """fully_shard's mesh: 1-D, or 2-D (dp_replicate, shard) under HSDP."""
    experts_fsdp: DeviceMesh | None = None
    ep: DeviceMesh | None = None
    cp: DeviceMesh | None = None
    tp: DeviceMesh | None = None
    pp: DeviceMesh | None = None
    same_params: dist.ProcessGroup | None = None
    """The process group of the ranks holding the same parameters (a Muon step's): None means every rank."""

    def size(self, role: str) -> int:
        """The size of role's group (1 where the layout has none)."""
        return self.layout.size(role)

    def local_rank(self, role: str) -> int:
        """This rank's index in role's group (0 where the layout has none)."""
        m = getattr(self, role)
        return m.get_local_rank() if isinstance(m, DeviceMesh) and m.ndim == 1 else 0

    def describe(self) -> dict[str, int]:
        """{dimension name: size}, outermost first (the start line's "mesh")."""
        return dict(self.layout.dims())


def build_mesh(device: torch.device | str, world_size: int, cfg: ParallelConfig | None = None) -> Mesh:
    """Layout.of(cfg, world_size).build(device) (collective); cfg None: plain FSDP over every rank."""
    return Layout.of(cfg or ParallelConfig(), world_size).build(device)
