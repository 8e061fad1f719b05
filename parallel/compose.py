"""The MoE and pipeline checks that are not pairs, which need no collective: one setting's own validity, sizes that
must divide, and the pipeline's notice at start-up. What does not run with what is composition.py's table, checked
before these, so that their remedies (another parallel.ep or micro-batch count) are never a pair it refuses.

cfg is a config.Config (duck-typed: this module sits below config.py).
"""
from __future__ import annotations

from core.errors import SetupError
from parallel.layout import ep_sizes
from parallel.pipeline import check_pp


def check_moe(cfg, world_size: int = 0) -> None:
    """Raise SetupError for a mixture of experts' own settings: top-1 routing with renormalised weights (its router
    would never learn), parallel.ep without experts, or not dividing model.n_experts. Run after
    composition.check_composition (what it does not run with: docs/cluster.md), so that the parallel.ep it offers is
    not refused next.

    world_size (0: unknown): the parallel.ep values offered must also fit its data-parallel shard ranks
    (layout.ep_sizes: divide them, or be parallel.cp, or cp x tp, times one that does).
    """
    m, p = cfg.model, cfg.parallel
    if p.ep > 1 and not m.n_experts:
        raise SetupError(f"parallel.ep {p.ep} splits the experts of a mixture of experts, and model.n_experts is 0 "
                         f"(dense); set --model.n_experts (a multiple of {p.ep}) or use parallel.ep 1")
    if not m.n_experts:
        return
    if m.experts_per_token == 1 and m.moe_renormalize and m.n_experts > 1:
        # One weight renormalised is 1 whatever the router scores, so the language-model loss gives the router no
        # gradient (issue 55: it moved 1e-6 in two steps where every other matrix moved 1e-3). Refused rather than computed as Switch's
        # top-1 behind the flag's back: that would change what a trained top-1 model and its Mixtral export
        # (which renormalises, weight 1) compute. First, so that the layout checks' remedies are not refused next.
        raise SetupError("model.experts_per_token 1 with model.moe_renormalize true weights each token's one expert "
                         "by 1 whatever the router scores, so the router gets no gradient and never learns; pass "
                         "--model.moe_renormalize false (the Switch Transformer's top-1: the expert's output times "
                         "its router score)")
    if m.n_experts % p.ep:
        inner = p.dp_replicate * p.cp * p.tp * p.pp
        shard = p.data_parallel(world_size) // p.dp_replicate if world_size and world_size % inner == 0 else 0
        fits = ep_sizes(shard, p.cp, p.tp, m.n_experts)
        raise SetupError(f"parallel.ep ({p.ep}) does not divide model.n_experts ({m.n_experts}): each EP rank holds "
                         f"whole experts, as many as the others; use parallel.ep in {fits}")


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
