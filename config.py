"""The root config of a run: it composes each module's own section, and the checks across them.

    [model] model.ModelArgs      [data] data.DataConfig        [train] TrainConfig (below)
    [optim] optimization/optimizers.OptimConfig    [parallel] parallel/layout.ParallelConfig
    [checkpoint] checkpoint.CheckpointConfig  [metrics] observability/metrics.MetricsConfig
    [eval] evaluation/downstream.EvalConfig (with [[eval.tasks]])

A field is checked where it is defined (each section's ``__post_init__``, ``Literal``
choices); ``validate`` keeps only what needs several sections, files or the world size.
The commands that read a finished run (evaluate, generate, export) get its config from
``load_run``.
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
from typing import Literal

import torch

from checkpoint import CheckpointConfig, CheckpointError, newest_checkpoint, read_metadata
from core import cli
from core.errors import ConfigError, SetupError
from data import DataConfig, read_meta
from data_pipeline import datacache, index_cache, mixture, pretokenized, token_rows
from data_pipeline.sources import check_source
from data_pipeline.tokenizer import eos_name, load_tokenizer, separator_ids
from evaluation.downstream import EvalConfig, check_tasks
from model import PRESETS, ModelArgs
from observability.metrics import MetricsConfig, check_metrics
from observability.profiling import parse_steps
from optimization.optimizers import OptimConfig
from parallel import float8
from parallel.compose import check_moe, check_pipeline
from parallel.composition import check_composition
from parallel.context_parallel import check_cp_layout
from parallel.distributed import local_world_size, resolve_device
from parallel.layout import Layout, ParallelConfig
from storage.fs import check_location, is_url
from storage.rundir import RunDir, check_local_dir


@dataclasses.dataclass
class BatchStage:
    """One [[train.batch_stages]] table: from a step on, the global batch is larger (a batch-size ramp)."""

    start_step: int = 0
    """Optimizer steps done before the stage starts: step start_step + 1 (as metrics.jsonl counts) is its first."""
    global_batch_size: int = 0
    """Sequences per optimizer step from then on; larger than the batch before it."""


MAX_SKIP = 1_000_000
"""Batches one [[train.skip]] table may skip (about 30 s for the loader to move a mixture past, at start-up)."""


@dataclasses.dataclass
class SkipRange:
    """One [[train.skip]] table: batches of the data that no step trains on (PaLM's remedy for a loss spike)."""

    start_step: int
    """The first batch skipped, numbered as the step that trains on it in a run without skips (1-based)."""
    end_step: int
    """The last batch skipped (>= start_step): the step after the range trains on batch end_step + 1."""


@dataclasses.dataclass
class TrainConfig:
    steps: int = 1000
    """Optimizer steps to train for (the LR schedule ends here)."""
    global_batch_size: int = 64
    """Sequences per optimizer step, summed over all data-parallel ranks and accumulation steps (until the first [[train.batch_stages]])."""
    batch_stages: list[BatchStage] = dataclasses.field(default_factory=list)
    """Batch-size ramp: [[train.batch_stages]] tables (start_step, global_batch_size), in order, each batch larger than the one before. The data cursor counts samples, and the LR schedule runs in samples (see optimization/optimizers.py), so both stay exact across a stage."""
    micro_batch_size: int = 0
    """Sequences per forward pass on one rank (0: global_batch_size / data-parallel size, no accumulation)."""
    seed: int = 0
    """Seed of the initial weights and of the data order."""
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Compute dtype in forward/backward: 'bfloat16' (mixed precision, fp32 master weights and reductions), 'float32', or 'auto': bfloat16 on CUDA, float32 on CPU (most CPUs have no fast bf16 matmul)."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """'auto' (CUDA when present, else CPU), 'cuda' or 'cpu'."""
    activation_checkpointing: Literal["none", "full", "selective"] = "none"
    """'none', 'full' (recompute every block in backward) or 'selective' (keep matmul outputs, recompute the rest)."""
    compile: bool = False
    """torch.compile each block."""
    log_interval: int = 10
    """Log train metrics every this many steps."""
    val_interval: int = 200
    """Validate every this many steps and at the end (0: never)."""
    val_batches: int = 4
    """Validation uses up to this many global batches of held-out sequences."""
    nonfinite: Literal["stop", "skip"] = "stop"
    """A non-finite gradient norm: 'stop' the run (the last checkpoint stays as it was) or 'skip' that step's update."""
    track_memory: bool = False
    """On CPU, record each logged step's peak memory (train records' peak_bytes) by the planner's accounting of every tensor (parallel/accounting.py; it slows a step). On CUDA peak_bytes is always recorded (torch.cuda.max_memory_allocated)."""
    profile_steps: str = ""
    """Profile these 1-based steps on rank 0, e.g. '10-12': a Chrome/Perfetto trace (and on CUDA a memory snapshot) in RUN_DIR/profile/ (empty: off)."""
    loss_chunk_size: int = 0
    """Tokens per chunk of the output projection + cross-entropy, each chunk's gradients computed in its forward (nothing recomputed), so the full (tokens x vocab) logits never exist (0: off). Not applied with parallel.tp > 1, where the logits are already split over the vocabulary (loss_parallel)."""
    z_loss: float = 0.0
    """Coefficient of the auxiliary loss z_loss * logsumexp(logits)^2 per token (PaLM, Chowdhery et al. 2022, section 5: 1e-4), which keeps the softmax normaliser near 1 (0: off). The logged loss stays the cross-entropy; the z term is logged as z_loss."""
    spike_skip: float = 0.0
    """Spike guard: skip the update of a step whose loss or gradient norm exceeds the mean + spike_skip standard deviations of the last spike_window steps (OLMo-core's SkipStepOptimizer uses 6); skipped steps are recorded in metrics.jsonl with "skipped" (0: off)."""
    spike_window: int = 128
    """Spike guard: steps in the running window; the guard acts once the window is full, and the window is saved in checkpoints."""
    skip: list[SkipRange] = dataclasses.field(default_factory=list)
    """[[train.skip]] tables (start_step, end_step): the loader draws no samples for those batches, numbered by the data's own steps (the batches a run without skips trains on); data stages and batch stages follow the data; overlapping tables skip their union. Megatron's --iterations-to-skip, exact at every world size."""
    rollback: int = 0
    """Automatic rollbacks the run may make (0: off): on a non-finite loss or gradient norm, or train.rollback_after consecutive outliers of the spike rule, every rank reloads the newest checkpoint at least train.rollback_margin steps before the first outlier and skips the data from there to the divergent step (training/rollback.py)."""
    rollback_after: int = 2
    """Consecutive steps the spike rule (train.spike_skip sigmas over train.spike_window steps) calls outliers that make a divergence; with train.spike_skip 0 only a non-finite loss or norm does."""
    rollback_margin: int = 1
    """A rollback loads a checkpoint of step <= first outlier - rollback_margin (>= 1: the checkpoint of the first outlier's own step already holds it)."""
    rollback_lr_factor: float = 1.0
    """Each rollback multiplies every LR of the schedule from then on by this factor, in (0, 1] (1: the LR is kept)."""
    float8: Literal["off", "tensorwise", "rowwise"] = "off"
    """Float8 matmuls in the blocks' Linear layers through torchao (pip install -e ".[float8]"; CUDA compute capability 8.9+: H100, H200 or newer): 'tensorwise' (float8 FSDP all-gather), 'rowwise' (closer to bf16, slower), or 'off'. The output projection, and an MoE's routers and routed experts, stay in high precision; checkpoints are the same as without. train_fsdp.py only."""
    collective_timeout_s: float = 300.0
    """Seconds (>= 1) a collective of the training loop waits for a peer rank from step 2 on; then this rank stops with one line naming the step (a hung or lost peer). Start-up and step 1 (compilation) wait up to 30 minutes, data preparation up to 24 hours."""

    def __post_init__(self) -> None:
        if self.steps <= 0:
            raise ConfigError(f"train.steps must be > 0, got {self.steps}")
        if not 0 <= self.seed < 2 ** 32:
            raise ConfigError(f"train.seed must be in 0..2**32-1, got {self.seed}")
        if self.log_interval <= 0:
            raise ConfigError(f"train.log_interval must be > 0, got {self.log_interval}")
        for name in ("val_interval", "val_batches", "micro_batch_size", "loss_chunk_size"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        # below 1 s a healthy step's own collectives (an all-gather of the weights, a checkpoint barrier) time out
        # and a live peer is blamed; the comparison also refuses nan and inf, which no timer takes
        if not 1 <= self.collective_timeout_s <= 1e7:
            raise ConfigError(f"train.collective_timeout_s must be a number of seconds in [1, 1e7], got "
                              f"{self.collective_timeout_s}; the default is 300")
        for name in ("z_loss", "spike_skip"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ConfigError(f"train.{name} must be a finite number >= 0 (0: off), got {getattr(self, name)}")
        if self.spike_window < 2:
            raise ConfigError(f"train.spike_window must be >= 2 steps (a standard deviation needs two), got "
                              f"{self.spike_window}")
        last_step, last_batch = 0, self.global_batch_size
        for i, stage in enumerate(self.batch_stages):
            where = f"train.batch_stages[{i}]"
            if stage.start_step <= last_step:
                raise ConfigError(f"{where}.start_step ({stage.start_step}) must be > {last_step} (the previous "
                                  f"stage's); list the stages in order of start_step, the first after step 0 "
                                  f"(train.global_batch_size is the batch from step 0)")
            if stage.global_batch_size <= last_batch:
                raise ConfigError(f"{where}.global_batch_size ({stage.global_batch_size}) must be larger than the "
                                  f"batch before it ({last_batch}): the stages ramp the batch up")
            last_step, last_batch = stage.start_step, stage.global_batch_size
        self._check_rollback()
        parse_steps(self.profile_steps)

    def _check_rollback(self) -> None:
        # Tables may overlap or nest: the union is skipped, so every rollback record pasted as a table (a later one
        # may contain an earlier one) gives the same run (docs/rollback.md).
        for i, r in enumerate(self.skip):
            where = f"train.skip[{i}]"
            if r.start_step < 1 or r.end_step < r.start_step:
                raise ConfigError(f"{where}: start_step ({r.start_step}) must be >= 1 and end_step ({r.end_step}) "
                                  f">= start_step: the range names the first and the last batch skipped")
            if r.end_step - r.start_step >= MAX_SKIP:
                raise ConfigError(f"{where}: {r.end_step - r.start_step + 1:,} batches skipped; at most {MAX_SKIP:,} "
                                  f"a table (a mixture moves past them batch by batch); check end_step")
        if self.rollback < 0:
            raise ConfigError(f"train.rollback must be >= 0 (0: off), got {self.rollback}")
        if self.rollback and self.rollback_after < 1:
            raise ConfigError(f"train.rollback_after must be >= 1 consecutive outlier steps with train.rollback on, "
                              f"got {self.rollback_after}; 2 tells a divergence from the single spike that "
                              f"train.spike_skip absorbs")
        if not 0 < self.rollback_lr_factor <= 1:
            raise ConfigError(f"train.rollback_lr_factor must be in (0, 1] (1: keep the LR), got "
                              f"{self.rollback_lr_factor}")
        if self.rollback_margin < 1:
            raise ConfigError(f"train.rollback_margin must be >= 1 step, got {self.rollback_margin}: the checkpoint "
                              f"of the first outlier's step already holds that outlier")

    def skip_ranges(self) -> list[tuple[int, int]]:
        """The [[train.skip]] ranges as [(start_step, end_step)], in order (overlapping ones as given: the loader merges)."""
        return sorted((r.start_step, r.end_step) for r in self.skip)

    def batch_schedule(self) -> list[tuple[int, int]]:
        """[(start_step, global_batch_size)] from step 0: train.global_batch_size, then the batch stages."""
        return [(0, self.global_batch_size)] + [(s.start_step, s.global_batch_size) for s in self.batch_stages]

    def batch_size_at(self, step: int) -> int:
        """The global batch of the step after `step` completed optimizer steps."""
        return mixture.stage_at(self.batch_schedule(), step)

    def micro_batch(self, dp: int, step: int = 0) -> int:
        """Sequences per forward pass with dp data-parallel ranks at step: micro_batch_size, or the whole per-rank share."""
        return self.micro_batch_size or self.batch_size_at(step) // max(dp, 1)


@dataclasses.dataclass
class Config:
    run_dir: str = "runs/default"
    """Directory of this run: metrics.jsonl, config.toml, checkpoints/, data/."""
    model: ModelArgs = dataclasses.field(default_factory=ModelArgs)
    """Model shape; 'preset = NAME' selects one of model.PRESETS, then fields override it."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    """Text source, tokenizer and packing."""
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    """Loop, batch, precision and memory options."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    """Optimizer (AdamW or Muon + AdamW), LR schedule and clipping."""
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    """Sharding options."""
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    """Checkpoint interval, retention, async saving, explicit resume path."""
    metrics: MetricsConfig = dataclasses.field(default_factory=MetricsConfig)
    """Where metrics go besides metrics.jsonl."""
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    """Downstream multiple-choice tasks scored as lm-evaluation-harness scores them, in the loop and by evaluate.py --tasks."""
    init_from_hf: str = ""
    """Hugging Face Llama folder whose weights replace the random init when the run has no checkpoint yet (continued pretraining); [model] must match its config.json, and data.tokenizer defaults to its tokenizer.json."""

    def __post_init__(self) -> None:
        if not 0 < self.data.seq_len <= self.model.max_seq_len:
            raise ConfigError(f"data.seq_len ({self.data.seq_len}) must be in 1..model.max_seq_len "
                              f"({self.model.max_seq_len}), the RoPE table length")


def compute_dtype(train: TrainConfig, device) -> str:
    """train.dtype with 'auto' resolved for device (a torch.device): 'bfloat16' on CUDA, 'float32' elsewhere."""
    if train.dtype != "auto":
        return train.dtype
    return "bfloat16" if device.type == "cuda" else "float32"


def parse_config(argv: list[str] | None = None, description: str = "", require_file: bool = False) -> Config:
    """Config from --config FILE and --section.field overrides; ConfigError on bad input, SystemExit(0) on --help.

    require_file: refuse a command line without --config (the defaults alone are a 179M-parameter
    GPU run, which nobody means to start by forgetting a flag).
    """
    args = sys.argv[1:] if argv is None else argv
    if require_file and not any(a == "--config" or a.startswith("--config=") for a in args) \
            and "--help" not in args and "-h" not in args:
        raise ConfigError("--config FILE.toml is required (the defaults alone are a 179M-parameter GPU run); "
                          "start with --config configs/debug.toml")
    return cli.parse_args(Config, argv, presets={"model": PRESETS}, description=description)


def check_tokenizer(path: str, model: ModelArgs, vocab_size: int | None = None, eos_token: str = "",
                    bos_token: str = "") -> None:
    """Raise SetupError (or DataError for an unreadable file) if the tokenizer.json at path does not fit
    model.vocab_size, has no document separator (data.eos_token or data.bos_token not in it, or no EOS
    of its own: tokenizer.separator_ids), or, with model.document_mask, its EOS id is not model.eot_id
    (documents would not be found). vocab_size: its size when known (a prepared corpus' meta.json);
    the file is then read only for the EOS check."""
    tok = load_tokenizer(path) if vocab_size is None or model.document_mask else None
    vocab_size = tok.get_vocab_size() if vocab_size is None else vocab_size
    if vocab_size > model.vocab_size:
        raise SetupError(
            f"tokenizer '{path}' has {vocab_size} tokens but model.vocab_size is {model.vocab_size}; "
            f"raise model.vocab_size or use a smaller tokenizer (data.tokenizer_vocab_size)"
        )
    if tok is None:
        return
    # here, on every rank, rather than in preparation, which names its temporary copy and runs between collectives
    eot, _ = separator_ids(path, eos_token, bos_token, tok=tok)
    if not model.document_mask:
        return
    if eot != model.eot_id:
        raise SetupError(f"tokenizer '{path}' has {eos_name(path, tok, eos_token)} at id {eot} but model.eot_id is "
                         f"{model.eot_id}; set --model.eot_id {eot} so document_mask finds the documents")


def check_pretokenized(d: DataConfig, model: ModelArgs, run_dir: str) -> None:
    """The start-up checks of every pre-tokenized source of d (pretokenized.check_source): indexes, sizes, dtypes,
    ids below model.vocab_size, documents ending with the tokenizer's EOS. Needs data.tokenizer (or the run's own
    prepared one); raises DataError or SetupError naming the field and the fix. No collective."""
    srcs = [s for s in d.source_list() if s.pretokenized]
    if not srcs:
        return
    if d.prepared:
        raise SetupError(f"data.prepared cannot carry {srcs[0].field('format')} {srcs[0].format}: a pre-tokenized "
                         f"source is read in place; give its files on a filesystem every node sees, without "
                         f"data.prepared")
    path = d.tokenizer or RunDir(run_dir).tokenizer  # a resume has the run's own
    if not os.path.isfile(path):  # a tokenizer trained here on the raw sources could not have made these ids
        raise SetupError(f"{srcs[0].field('format')} {srcs[0].format}: the source holds token ids, so give "
                         f"--data.tokenizer, the tokenizer.json it was tokenized with")
    tok = load_tokenizer(path)
    eos, _ = separator_ids(path, d.eos_token, d.bos_token, tok)
    meta = os.path.join(RunDir(run_dir).data, "meta.json")
    records = read_meta(RunDir(run_dir).data)["sources"] if os.path.isfile(meta) else {}
    index_cache.load(RunDir(run_dir).data)  # a resume: what the indexes said, by content key, not the indexes
    for src in srcs:
        if is_url(src.dataset) and src.format != "tokens":  # read in place from the bucket: reachable, with credentials
            check_location(src.dataset, src.field("dataset"))
        if src.format == "tokens":  # materialised by preparation, which checks its ids; here its files and column
            token_rows.token_files(src)
            continue
        shards = pretokenized.check_source(src, tok.get_vocab_size(), model.vocab_size, eos,
                                           eos_name(path, tok, d.eos_token))
        then = records.get(src.name, {})
        if "shards" in then and then.get("config") == src.reading():  # a resume: the corpus it started with
            now = pretokenized.identity(shards)
            if then["files"]["digest"] != now["digest"]:
                raise pretokenized.corpus_changed(src, RunDir(run_dir).data, then["files"], now)


def check_rollback_reach(t: TrainConfig, ckpt: CheckpointConfig) -> None:
    """train.rollback needs a checkpoint to go back to: raises SetupError when none can be kept far enough back.

    At a divergence of step S whose first outlier is F = S - rollback_after + 1, the target is a
    checkpoint of step <= F - rollback_margin. Saves come every checkpoint.interval steps and the
    newest checkpoint.keep are kept, so the oldest one kept can be as recent as S - keep * interval:
    margin + rollback_after - 1 must fit in keep * interval steps (keep 0 keeps all).
    """
    if not t.rollback:
        return
    if ckpt.interval >= t.steps:
        raise SetupError(f"train.rollback needs checkpoints to roll back to, but checkpoint.interval "
                         f"({ckpt.interval}) saves only at the end of train.steps ({t.steps}); lower "
                         f"checkpoint.interval or set train.rollback 0")
    reach = t.rollback_margin + (t.rollback_after - 1)
    if ckpt.keep and reach > ckpt.keep * ckpt.interval:
        raise SetupError(f"train.rollback_margin ({t.rollback_margin}) reaches further back than the checkpoints "
                         f"kept: a rollback needs one {reach} steps before the divergent step "
                         f"(rollback_margin + rollback_after - 1), but checkpoint.keep {ckpt.keep} x "
                         f"checkpoint.interval {ckpt.interval} keeps as few as {ckpt.keep * ckpt.interval}; lower the "
                         f"margin or raise checkpoint.keep")


def validate_layout(cfg: Config, world_size: int, local_world_size: int) -> None:
    """validate's checks of the settings and the sizes alone, for world_size ranks of which local_world_size share
    a node: what does not run together, the MoE's and the layout's sizes, the global batch's split, the pipeline's
    and the rollback's. They need no device, data, file or collective, so plan.py checks a layout of any size
    with them, as the trainer does; raises SetupError (ConfigError) naming the fields and the fix.
    """
    t, d, tp = cfg.train, cfg.data, cfg.parallel.tp
    check_composition(cfg)
    check_moe(cfg, world_size)
    Layout.of(cfg.parallel, world_size).check(local_world_size, cfg.model.n_experts)
    m = cfg.model
    check_cp_layout(cfg.parallel.cp, tp, d.seq_len, m.n_heads, m.n_kv_heads)
    dp = cfg.parallel.data_parallel(world_size)
    for i, (start, g) in enumerate(t.batch_schedule()):
        name = "train.global_batch_size" if i == 0 else f"train.batch_stages[{i - 1}].global_batch_size"
        micro = t.micro_batch(dp, start)
        if not t.micro_batch_size and (g <= 0 or g % dp):  # the user set only the global batch
            raise SetupError(f"{name} ({g}) must be a positive multiple of data-parallel size ({dp}), "
                             f"so that every rank takes an equal share; change it or the number of processes")
        if g <= 0 or g % (dp * micro):
            raise SetupError(f"{name} ({g}) must be a positive multiple of data-parallel size ({dp}) "
                             f"x train.micro_batch_size ({micro}) = {dp * micro}; change one of them")
    check_pipeline(cfg, world_size)
    check_rollback_reach(t, cfg.checkpoint)


def validate(cfg: Config, world_size: int) -> None:
    """The checks across sections, files and the world size; needs no collective (run on every rank, first).

    Raises SetupError (or DataError for a source) naming the fields and the fix: world size
    not divisible by parallel.tp, a global batch that does not split over the data-parallel
    ranks and micro-batches, a device that is not there, CPU offload without CUDA, a missing
    source, a pre-tokenized source's bad or changed files (check_pretokenized), a tokenizer (data.tokenizer, or the one a run directory was prepared with) larger
    than the model's vocabulary or whose [EOT] id is not model.eot_id under document_mask, an
    unwritable run directory, a local [[eval.tasks]] file that is unreadable or lacks its
    columns or has a gold index out of range; a StorageError for a checkpoint or data URL that
    cannot be used (unknown scheme, no credentials, no such bucket, no endpoint), a
    data.prepared whose meta.json does not match the data settings; a MissingPackageError for
    metrics.tensorboard or metrics.wandb without its package, or an s3:// URL without s3fs;
    and train.float8's checks (float8.check: torchao, a float8-capable GPU; on a CPU rank 0 prints
    its notice that float8 is only emulated); check_moe's refusals. First of all, the settings that
    do not run together (composition.TABLE, docs/cluster.md): the sizes the later checks offer
    keep the settings on or turn them off, so no remedy of theirs is a pair the table refuses.
    """
    t, d = cfg.train, cfg.data
    validate_layout(cfg, world_size, local_world_size())
    device = resolve_device(t.device)
    if cfg.parallel.cpu_offload and device.type != "cuda":
        raise SetupError("parallel.cpu_offload needs a CUDA run; on CPU the parameters are in CPU memory already")
    float8.check(t.float8, device)
    if device.type == "cuda" and local_world_size() > torch.cuda.device_count():
        raise SetupError(f"{local_world_size()} processes on this node (LOCAL_WORLD_SIZE) but {torch.cuda.device_count()} "
                         f"visible GPU(s); launch --nproc_per_node={torch.cuda.device_count()} or fewer")
    check_metrics(cfg.metrics, cfg.run_dir)
    check_pretokenized(d, cfg.model, cfg.run_dir)
    if not d.prepared:  # with data.prepared the sources and the tokenizer file need not be on this node
        check_source(d)
        if d.tokenizer:
            check_tokenizer(d.tokenizer, cfg.model, eos_token=d.eos_token, bos_token=d.bos_token)
        elif d.tokenizer_vocab_size > cfg.model.vocab_size:
            raise SetupError(
                f"data.tokenizer_vocab_size ({d.tokenizer_vocab_size}) is larger than model.vocab_size "
                f"({cfg.model.vocab_size}); lower the first or raise the second"
            )
    check_tasks(cfg.eval)
    check_location(cfg.checkpoint.dir, "--checkpoint.dir")
    if cfg.checkpoint.dir and not is_url(cfg.checkpoint.dir):  # else a traceback after the data is prepared
        check_local_dir(cfg.checkpoint.dir, "--checkpoint.dir")
    check_location(cfg.checkpoint.load_from, "--checkpoint.load_from")
    check_run_dir(cfg.run_dir)
    if d.prepared:
        check_location(d.prepared, "--data.prepared")
        vocab = datacache.remote_meta(d)["vocab_size"]  # and its settings against d
        if vocab > cfg.model.vocab_size:
            raise SetupError(f"--data.prepared {d.prepared} has a tokenizer of {vocab} tokens but model.vocab_size "
                             f"is {cfg.model.vocab_size}; raise model.vocab_size")
        return
    prepared = RunDir(cfg.run_dir).tokenizer
    if os.path.isfile(prepared):  # a run directory prepared before: its tokenizer is the run's
        check_tokenizer(prepared, cfg.model, eos_token=d.eos_token, bos_token=d.bos_token)


def check_run_dir(run_dir: str) -> None:
    """Check that run_dir is a local directory that can be written (rundir.check_local_dir); creates nothing.

    lock_run_dir creates it when the run starts, so a start refused later leaves no trace.
    Raises SetupError naming it (a URL, empty, a file, unwritable, an impossible path) and the fix.
    """
    check_local_dir(run_dir, "--run_dir", "; checkpoints can go to object storage with --checkpoint.dir s3://BUCKET/PREFIX")


def load_run(run_dir: str, checkpoint: str = "") -> tuple[Config, str, str]:
    """(config, checkpoint path, tokenizer.json path) of a training run directory; no process group needed.

    checkpoint: a checkpoint directory or URL, or "" for the newest complete one of the run (its
    checkpoint.dir, by default run_dir/checkpoints).
    Raises CheckpointError when the run has no config.toml, tokenizer or complete checkpoint,
    ConfigError when its config.toml does not parse.
    """
    run = RunDir(run_dir)
    cfg_path = run.config
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"run directory '{run_dir}' has no config.toml; give the --run_dir of a training run")
    cfg = parse_config(["--config", cfg_path])
    check_location(checkpoint or cfg.checkpoint.dir, "--checkpoint")
    if checkpoint:
        read_metadata(checkpoint)
    else:
        checkpoint = newest_checkpoint(cfg.checkpoint.root(run_dir))
    tokenizer = run.tokenizer
    if cfg.data.prepared and not os.path.isfile(tokenizer):
        tokenizer = datacache.tokenizer_path(cfg.data, run_dir)
    if not os.path.isfile(tokenizer):
        raise CheckpointError(f"run directory '{run_dir}' has no data/tokenizer.json")
    return cfg, checkpoint, tokenizer

