"""What composes with what: the refusals of a mixture of experts, expert and pipeline parallelism that need no
collective, run by config.validate before the layout checks (docs/moe.md and docs/pipeline.md hold the tables).

cfg is a config.Config (duck-typed: this module sits below config.py).
"""
from __future__ import annotations

from core.errors import SetupError
from parallel.pipeline import check_pp
from parallel.pipeline_stages import ZERO_BUBBLE


def check_moe(cfg, world_size: int = 0) -> None:
    """Raise SetupError for what a mixture of experts does not compose with: top-1 routing with renormalised
    weights (its router would never learn), parallel.ep without experts, or not dividing model.n_experts, or with
    parallel.tp or parallel.cp > 1, or with selective checkpointing and compile together; train.float8 (docs/moe.md).

    world_size (0: unknown): the parallel.ep values offered must also divide its data-parallel shard ranks.
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
        fits = [d for d in range(1, m.n_experts + 1) if m.n_experts % d == 0 and (not shard or shard % d == 0)]
        raise SetupError(f"parallel.ep ({p.ep}) does not divide model.n_experts ({m.n_experts}): each EP rank holds "
                         f"whole experts, as many as the others; use parallel.ep in {fits}")
    if p.ep > 1 and (p.tp > 1 or p.cp > 1):
        other = f"parallel.tp {p.tp}" if p.tp > 1 else f"parallel.cp {p.cp}"
        raise SetupError(f"parallel.ep {p.ep} does not run with {other} yet (docs/moe.md); use parallel.ep 1 with "
                         f"{other}, or parallel.ep with FSDP or HSDP")
    if p.ep > 1 and cfg.train.activation_checkpointing == "selective" and cfg.train.compile:
        # Eager, each pair runs (tests/test_moe.py, and compile with full checkpointing was run once); together, the
        # compiled blocks' recompute replays the experts' all-to-all and its waits in another order than their forward
        # did, and selective checkpointing's replay fails at the first backward (torch 2.13, CPU).
        raise SetupError(f"parallel.ep {p.ep} does not run with train.activation_checkpointing selective and "
                         f"train.compile true together yet (docs/moe.md); use train.activation_checkpointing full, "
                         f"or train.compile false")
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

ZERO_BUBBLE_REFUSED = {
    # The weight-gradient pass is a second backward through the graph the input-gradient pass already ran: the
    # checkpointed blocks' recompute runs again and its context, made once per forward, cannot be entered twice
    # (AttributeError: '_GeneratorContextManager' object has no attribute 'args'), and a compiled block's backward
    # has donated (freed) the buffers the second pass needs ("compiled with non-empty donated buffers"); with
    # torch._functorch.config.donated_buffer off it trains, to wrong gradients (ZBVZeroBubble at pp 2: step 2's loss
    # 8.3531 against one process's 8.3521, which it matches without compile).
    "train.activation_checkpointing": (lambda c: c.train.activation_checkpointing != "none",
                                       "train.activation_checkpointing none", "the recompute"),
    "train.compile": (lambda c: c.train.compile, "train.compile false", "a compiled backward"),
}
"""What the zero-bubble schedules (pipeline_stages.ZERO_BUBBLE) do not run with yet, by the setting's name: (whether
cfg sets it, the setting that turns it off, what cannot run twice); the other schedules run one backward per
micro-batch and take both."""


def without_zero_bubble(p) -> str:
    """The schedule to offer instead of p.pp_schedule, a zero-bubble one, that every other check takes with the same
    stages and micro-batches: Interleaved1F1B for InterleavedZeroBubble (the same rules), 1F1B for the V-shaped ones
    (Interleaved1F1B would refuse some micro-batch counts they take, e.g. 5 at pp 2)."""
    if p.pp_schedule == "InterleavedZeroBubble":
        return "parallel.pp_schedule Interleaved1F1B"
    return "parallel.pp_schedule 1F1B" + (" and parallel.pp_stages_per_rank 0" if p.pp_stages_per_rank else "")


def check_pipeline_composes(cfg) -> None:
    """Raise SetupError for parallel.pp > 1 with what it does not run with yet (PIPELINE_REFUSED), and for a
    zero-bubble parallel.pp_schedule with what it does not (ZERO_BUBBLE_REFUSED).

    Run before the layout checks, so that their remedy (e.g. more processes for parallel.ep) is
    not one this refusal then rejects.
    """
    p = cfg.parallel
    if p.pp == 1:
        return
    refused = [(name, off) for name, (on, off) in PIPELINE_REFUSED.items() if on(cfg)]
    zero_bubble = [(name, off, what) for name, (on, off, what) in ZERO_BUBBLE_REFUSED.items()
                   if on(cfg)] if p.pp_schedule in ZERO_BUBBLE else []
    if refused:  # named with the zero-bubble ones, so that one fix is enough
        refused += [(f"{name} (under {p.pp_schedule})", off) for name, off, _ in zero_bubble]
        raise SetupError(f"parallel.pp {p.pp} does not run with {', '.join(n for n, _ in refused)} yet "
                         f"(docs/pipeline.md); use {' and '.join(off for _, off in refused)}, or parallel.pp 1")
    if zero_bubble:
        raise SetupError(f"parallel.pp_schedule {p.pp_schedule} does not run with "
                         f"{', '.join(n for n, _, _ in zero_bubble)} yet: its weight-gradient pass is a second "
                         f"backward through each micro-batch, which {' and '.join(w for _, _, w in zero_bubble)} "
                         f"cannot run (docs/pipeline.md); use {' and '.join(off for _, off, _ in zero_bubble)}, or "
                         f"{without_zero_bubble(p)}")


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
