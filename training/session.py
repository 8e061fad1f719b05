"""Building a run on one rank: mesh, data, sharded model, optimizer, checkpoints, and where it starts from.

build() is collective: every rank calls it with the same Config. It resumes from the newest
complete checkpoint (or checkpoint.load_from, or init_from_hf weights) after checking that the
checkpoint fits this model and data, so the loop only ever continues a consistent state.
"""
from __future__ import annotations

import dataclasses

import torch

import hf
from checkpoint import AppState, Checkpointer
from config import Config, check_tokenizer
from core import cli
from core.errors import SetupError, UserError
from data import PackedCorpus
from data_pipeline import datacache
from data_pipeline.loader import DataState, GlobalBatchLoader
from evaluation.downstream import Task, load_tasks
from model import num_params
from optimization.optimizers import scale_lr
from parallel import distributed
from parallel.layout import Layout, Mesh
from parallel.parallelize import TPPlan, copy_sharded
from prepare import prepare_on_all_ranks
from storage.rundir import RunDir
from training.planned import PlannedPeak
from training.resume import claim_checkpoint_dir, resume_point
from training.step import Trainable, build_trainable


@dataclasses.dataclass
class Session(Trainable):
    """Everything built for a run on one rank, before the loop: the Trainable, its data and its checkpoints."""

    corpus: PackedCorpus
    loader: GlobalBatchLoader
    micro_batch_size: int
    ckpt: Checkpointer
    app: AppState
    meta: dict
    resumed_from: str | None
    resume_note: str = ""
    """What changed since the checkpoint that the run carries over (for the start-up line)."""
    tasks: list[Task] = dataclasses.field(default_factory=list)
    """The [[eval.tasks]], read and tokenized."""
    planned: PlannedPeak | None = None
    """plan.py's run beside this one, on rank 0 when the run records its peak (for the start-up line)."""


def build(cfg: Config, rank: int, world_size: int, device: torch.device, tp_plan: TPPlan | None = None,
          resume: bool = True) -> Session:
    """Mesh, data, sharded model, optimizer and checkpointer (collective); resumes if a checkpoint exists.

    tp_plan: train_2d.py's plan, used when cfg.parallel.tp > 1. Raises SetupError (on every
    rank) for bad data or a checkpoint that does not fit the model.
    """
    mesh = Layout.of(cfg.parallel, world_size).build(device)
    dp = mesh.size("data")
    torch.manual_seed(cfg.train.seed)

    ckpt = Checkpointer(cfg.checkpoint, cfg.checkpoint.root(cfg.run_dir), rank, cli.to_toml(cfg))
    # Where the run starts from, checked against this config before the data is prepared: a checkpoint
    # that cannot continue under it is refused before minutes of tokenizing.
    path, note = distributed.on_rank0(lambda: resume_point(cfg, ckpt), rank) if resume else (None, "")

    # Data: all ranks tokenize their share of the corpus into the run directory, or each node
    # copies a published one (data.prepared) into its cache; then every rank maps it.
    data_dir = RunDir(cfg.run_dir).data
    try:
        if cfg.data.prepared:
            data_dir, meta = datacache.fetch(cfg.data, datacache.cache_dir(cfg.data, cfg.run_dir))
        else:
            meta = prepare_on_all_ranks(cfg.data, data_dir)
    except UserError as e:
        raise SetupError(str(e)) from None
    check_tokenizer(meta["tokenizer"], cfg.model, meta["vocab_size"], cfg.data.eos_token)
    if resume:
        distributed.on_rank0(lambda: claim_checkpoint_dir(cfg, ckpt.root), rank)
    corpus = PackedCorpus(data_dir, cfg.data, cfg.model.vocab_size)
    micro = cfg.train.micro_batch(dp)
    data_state = DataState()
    loader = GlobalBatchLoader(corpus, cfg.train.global_batch_size, cfg.train.micro_batch_size,
                               mesh.local_rank("data"), dp, cfg.train.seed, data_state,
                               cfg.train.batch_schedule()[1:], cfg.train.skip_ranges())

    tr = build_trainable(cfg, rank, mesh, device, tp_plan)
    app = AppState(tr.model, tr.optimizer, tr.scheduler, tr.train_state, data_state, rank)
    tasks = distributed.on_rank0(lambda: load_tasks(cfg.eval, meta["tokenizer"], cfg.model.max_seq_len),
                                 rank) if cfg.eval.tasks else []
    if path is not None:
        ckpt.load(path, app)
        scale_lr(tr.scheduler, cfg.train.rollback_lr_factor ** tr.train_state.rollbacks)
    elif cfg.init_from_hf:  # every rank reads the folder and keeps its own shards: no communication
        hf.load_hf_into(tr.model, cfg.init_from_hf, copy_=copy_sharded)
    return Session(**vars(tr), corpus=corpus, loader=loader, micro_batch_size=micro, ckpt=ckpt, app=app, meta=meta,
                   resumed_from=path, resume_note=note, tasks=tasks)


def loss_description(cfg: Config, mesh: Mesh) -> str:
    """How the loss is computed, for the start-up line (says when loss_chunk_size is not applied)."""
    chunk = cfg.train.loss_chunk_size
    if mesh.tp is not None:
        loss = "vocab-parallel" + (" (train.loss_chunk_size is not applied under tp)" if chunk else "")
    else:
        loss = f"in chunks of {chunk} tokens" if chunk else "on full logits"
    return f"{'document-masked' if cfg.model.document_mask else 'causal'} attention, loss {loss}"


def parametrization_note(cfg) -> str:
    """' (mup, base_dim 64)' for the start line under mup/completep, with base_head_dim and the base multipliers
    that are not at their defaults (', mup_input_mult 16'); '' under sp."""
    m = cfg.model
    if m.parametrization == "sp":
        return ""
    depth = f", base_n_layers {m.base_n_layers}" if m.parametrization == "completep" else ""
    given = [f", {f} {getattr(m, f):g}" for f in ("base_head_dim", "mup_input_mult", "mup_output_mult", "mup_attn_mult")
             if getattr(m, f) != (0 if f == "base_head_dim" else 1.0)]
    return f" ({m.parametrization}, base_dim {m.base_dim}{depth}{''.join(given)})"


def params_description(m) -> str:
    """'12.34M' for a dense model; '40.12M total, 12.34M active (MoE: 8 experts, top 2)' for a mixture of experts."""
    total = f"{num_params(m) / 1e6:.2f}M"
    if not m.n_experts:
        return total
    shared = f", {m.n_shared_experts} shared" if m.n_shared_experts else ""
    return (f"{total} total, {num_params(m, active=True) / 1e6:.2f}M active (MoE: {m.n_experts} experts, top "
            f"{m.experts_per_token}{shared})")


def start_line(s: Session, fpt: float) -> str:
    """The one line a run prints when it starts: layout, model, corpus, attention and loss, where it starts from, and
    plan.py's peak when the run records its own (training/planned.py)."""
    cfg, mesh = s.cfg, s.mesh
    # numpy token files do not count their documents (meta.json's -1), so the sum leaves them out
    uncounted = " (and numpy files' uncounted)" if any(t.n_documents < 0 for t in s.corpus.sources) else ""
    start = (f"resumed from {s.resumed_from} at step {s.train_state.step}" if s.resumed_from else
             f"weights from {cfg.init_from_hf}" if cfg.init_from_hf else "fresh start")
    return (f"[train] mesh {mesh.describe()} device {s.device.type} {cfg.train.dtype} | "
            f"params {params_description(cfg.model)}{parametrization_note(cfg)} | {fpt / 1e6:.1f} MFLOP/token | "
            f"corpus {s.meta['n_tokens']:,} tokens in {s.meta['n_documents']} docs{uncounted}, "
            f"{s.corpus.n_train} train / {s.corpus.n_val} val sequences{s.corpus.describe()} | {loss_description(cfg, mesh)} | {start}"
            + s.runner.describe()
            + (f" | {s.resume_note}" if s.resume_note else "") + guard_description(s)
            + (s.planned.describe() if s.planned is not None else ""))


def guard_description(s: Session) -> str:
    """' | ...' on the rollback guard and the batches skipped (for the start-up line), or ''."""
    t, parts = s.cfg.train, []
    if t.rollback:
        trigger = (f"a non-finite step or {t.rollback_after} outliers in a row (spike_skip {t.spike_skip:g} sigma "
                   f"over spike_window {t.spike_window} steps, from step {t.spike_window + 1})" if t.spike_skip
                   else "a non-finite step only (train.spike_skip 0)")
        parts.append(f"rollback: {t.rollback - s.train_state.rollbacks} of {t.rollback} left, on {trigger}")
    skipped = s.loader.skipped()
    if skipped:
        parts.append("data steps skipped: " + ", ".join(f"{a}-{b}" for a, b in skipped))
    return "".join(f" | {p}" for p in parts)
