"""What composes with what: the refusals of a mixture of experts, expert and pipeline parallelism that need no
collective, run by config.validate before the layout checks (docs/moe.md and docs/pipeline.md hold the tables).

cfg is a config.Config (duck-typed: this module sits below config.py).
"""
from __future__ import annotations

from core.errors import SetupError
from parallel.pipeline import check_pp


def check_moe(cfg, world_size: int = 0) -> None:
    """Raise SetupError for what a mixture of experts does not compose with: parallel.ep without experts, or
    not dividing model.n_experts, or with parallel.tp or parallel.cp > 1; train.float8 (docs/moe.md).

    world_size (0: unknown): the parallel.ep values offered must also divide its data-parallel shard ranks.
    """
    m, p = cfg.model, cfg.parallel
    if p.ep > 1 and not m.n_experts:
        raise SetupError(f"parallel.ep {p.ep} splits the experts of a mixture of experts, and model.n_experts is 0 "
                         f"(dense); set --model.n_experts (a multiple of {p.ep}) or use parallel.ep 1")
    if not m.n_experts:
        return
    if m.n_experts % p.ep:
        inner = p.dp_replicate * p.cp * p.tp * p.pp
        shard = p.data_parallel(world_size) // p.dp_replicate if world_size and world_size % inner == 0 else 0
        fits = [d for d in range(1, m.n_experts + 1) if m.n_experts % d == 0 and (not shard or shard % d == 0)]
        raise SetupError(f"parallel.ep ({p.ep}) does not divide model.n_experts ({m.n_experts}): each EP rank holds "
                         f"whole experts, as many as the others; use parallel.ep in {fits}")
    if p.ep > 1 and (p.tp > 1 or p.cp > 1):
        other = f"parallel.tp {p.tp}" if p.tp > 1 else f"parallel.cp {p.cp}"
        raise SetupError(f"parallel.ep {p.ep} does not run with {other} yet (docs/moe.md); use parallel.ep 1 with "
                         f"{other}, or parallel.ep with FSDP or HSDP")
    if cfg.train.float8 != "off":
        raise SetupError(f"model.n_experts {m.n_experts} (mixture of experts) does not run with train.float8 "
                         f"{cfg.train.float8} yet (docs/moe.md); use train.float8 off or train a dense model")


PIPELINE_REFUSED = {
    "train.loss_chunk_size": (lambda c: c.train.loss_chunk_size > 0, "train.loss_chunk_size 0"),
    "train.float8": (lambda c: c.train.float8 != "off", "train.float8 off"),
    # The stages' receive buffers are sized at the first step: a larger micro-batch later aborts gloo.
    "[[train.batch_stages]]": (lambda c: bool(c.train.batch_stages), "no [[train.batch_stages]] tables"),
}
"""What pipeline parallelism does not run with yet (docs/pipeline.md's table), by the setting's name: (whether cfg
sets it, the setting that turns it off)."""


def check_pipeline_composes(cfg) -> None:
    """Raise SetupError for parallel.pp > 1 with what it does not run with yet (PIPELINE_REFUSED).

    Run before the layout checks, so that their remedy (e.g. more processes for parallel.ep) is
    not one this refusal then rejects.
    """
    p = cfg.parallel
    refused = [(name, off) for name, (on, off) in PIPELINE_REFUSED.items() if on(cfg)] if p.pp > 1 else []
    if refused:
        raise SetupError(f"parallel.pp {p.pp} does not run with {', '.join(n for n, _ in refused)} yet "
                         f"(docs/pipeline.md); use {' and '.join(off for _, off in refused)}, or parallel.pp 1")


def check_pipeline(cfg, world_size: int) -> None:
    """Raise SetupError for an unknown parallel.pp_schedule (at any pp), and at parallel.pp > 1 for stages,
    schedule or micro-batches that cannot work (pipeline.check_pp); run after the global batch is known to split
    over the data-parallel ranks."""
    p, t = cfg.parallel, cfg.train
    dp = p.data_parallel(world_size)
    check_pp(p.pp, p.pp_schedule, p.pp_microbatches, cfg.model.n_layers, t.global_batch_size // max(dp, 1),
             dp, t.micro_batch_size or 1, p.pp_stages_per_rank)


def pipeline_notice(parallel, micro_batch_size: int = 0) -> str:
    """One line for the start when a setting does not do what it says: a pipeline setting (pp_schedule,
    pp_microbatches, pp_stages_per_rank) at parallel.pp 1, or train.micro_batch_size (given as micro_batch_size)
    under parallel.pp > 1, whose micro-batches replace its gradient accumulation; else ''. parallel: a
    ParallelConfig.

    Not an error: a config written for a pipelined cluster run, tried at pp 1, is legitimate.
    """
    if parallel.pp > 1:
        if not micro_batch_size:
            return ""
        return (f"[train] notice: at parallel.pp {parallel.pp} the pipeline's micro-batches (parallel.pp_microbatches; "
                f"the start line says how many) replace train.micro_batch_size {micro_batch_size}'s gradient "
                f"accumulation")
    given = [f"parallel.{name} {value}" for name, value, default in (
        ("pp_schedule", parallel.pp_schedule, "1F1B"), ("pp_microbatches", parallel.pp_microbatches, 0),
        ("pp_stages_per_rank", parallel.pp_stages_per_rank, 0)) if value != default]
    if not given:
        return ""
    one = len(given) == 1
    return (f"[train] notice: {', '.join(given)} {'has' if one else 'have'} no effect at parallel.pp 1 (no "
            f"pipeline): {'it applies' if one else 'they apply'} from parallel.pp 2 (docs/pipeline.md)")
