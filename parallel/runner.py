"""Runners: what the step, validation and scoring ask of the model, the same at every layout.

A runner runs this rank's part of the model. ``OneStage`` runs the whole model (pp 1);
``pipeline.Pipeline`` runs a pipeline stage under its schedule. Both have:
  forward_backward(micro_batches, n_targets, hooks)  the step's forward and backward
  forward_loss(inputs, labels, layout)               a batch's summed token cross-entropy
  token_logprobs(inputs, targets)                    each target token's log-probability
  holds_loss        whether this rank's sums count (the last stage's rank)
  sum_over_stages   a rank's sums joined over the stages (nothing with one)
  across_stages     the group of the ranks running the other stages (None with one): the
                    gradient norm is the whole model's
  modules           the FSDP roots this rank runs; describe(): the start line's words
"""
from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from nn.documents import SequenceLayout
from nn.loss import applied_chunk_size, loss_context, token_logprobs, token_loss_sum, token_loss_sums
from parallel.context_parallel import shard_batch
from parallel.hooks import StepHook, aux_of
from parallel.layout import Mesh
from parallel.pipeline import Pipeline, build_pipeline, default_microbatches


@dataclasses.dataclass
class OneStage:
    """The runner of a whole model on each rank (no pipeline)."""

    model: nn.Module
    mesh: Mesh
    device: torch.device
    loss_chunk_size: int = 0
    """train.loss_chunk_size (not applied under TP: nn.loss.applied_chunk_size)."""
    z_loss: float = 0.0
    holds_loss = True
    across_stages = None

    @property
    def modules(self) -> list[nn.Module]:
        return [self.model]

    @property
    def vocab_parallel(self) -> bool:
        """Whether the logits are vocabulary-sharded (TP)."""
        return self.mesh.tp is not None

    def describe(self) -> str:
        return ""

    def sum_over_stages(self, t: Tensor) -> None:
        """Nothing: the whole model is here."""

    def forward_backward(self, micro_batches, n_targets: int, hooks: list[StepHook] = ()) -> tuple[Tensor, Tensor]:
        """Forward and backward over this rank's micro-batches of one step; gradients accumulate.

        micro_batches: [(inputs, labels)], each (mb, seq_len) int64. Every micro-batch's
        objective sum (token cross-entropy, plus train.z_loss's term: loss.token_loss_sums) is
        divided by n_targets, the global count of target tokens of the step, and multiplied by
        the loss ranks (data-parallel x CP) because FSDP averages gradients over them: the
        gradient is exactly that of the global mean token objective, however the batch is split.
        Under CP each rank runs its slice of every window (context_parallel.shard_batch). The
        hooks' auxiliary losses (token sums) join the objective, normalised as the cross-entropy.
        Returns this rank's summed token cross-entropy and summed logsumexp^2 (0 without z_loss),
        0-dim fp32 tensors on the device (no host sync).
        """
        device = self.device
        loss_sum = torch.zeros((), device=device)
        z_total = torch.zeros((), device=device)
        scale = self.mesh.size("loss") / n_targets
        chunk = applied_chunk_size(self.vocab_parallel, self.loss_chunk_size)
        for i, (inputs, labels) in enumerate(micro_batches):
            self.model.set_requires_gradient_sync(i == len(micro_batches) - 1)  # reduce-scatter once per step
            with loss_context(self.vocab_parallel)():
                inputs, labels, layout = shard_batch(self.model, inputs.to(device, non_blocking=True),
                                                     labels.to(device, non_blocking=True), self.mesh.cp)
                objective, z_sum = token_loss_sums(self.model, inputs, labels, chunk, self.z_loss, layout)
                aux = aux_of(hooks, self.model)  # before backward: recomputation may run forward again
                ((objective if aux is None else objective + aux) * scale).backward()
            loss_sum += objective.detach() - self.z_loss * z_sum
            z_total += z_sum
        return loss_sum, z_total

    def forward_loss(self, inputs: Tensor, labels: Tensor, layout: SequenceLayout | None = None) -> Tensor:
        """Summed token cross-entropy of a batch (batch, seq) (fp32 0-dim; chunked as applied)."""
        with loss_context(self.vocab_parallel)():
            return token_loss_sum(self.model, inputs, labels, applied_chunk_size(self.vocab_parallel,
                                                                                 self.loss_chunk_size), layout)

    def token_logprobs(self, inputs: Tensor, targets: Tensor) -> Tensor:
        """nn.loss.token_logprobs: (batch, seq) fp32."""
        with loss_context(self.vocab_parallel)():
            return token_logprobs(self.model, inputs, targets, self.vocab_parallel)


Runner = OneStage | Pipeline
"""What runs this rank's part of the model: the whole of it, or its pipeline stages."""


def build_runner(model: nn.Module, mesh: Mesh, cfg, device, act_dtype: torch.dtype) -> Runner:
    """This rank's runner: OneStage, or under pipeline parallelism (mesh.pp) the Pipeline of its stages.

    cfg: a config.Config (duck-typed: this module sits below config.py). act_dtype: the blocks'
    compute dtype, which pipeline stages pass on.
    """
    t, p = cfg.train, cfg.parallel
    if mesh.pp is None:
        return OneStage(model, mesh, device, t.loss_chunk_size, t.z_loss)
    local = t.global_batch_size // mesh.size("data")
    return build_pipeline(model, mesh, device, p.pp_schedule,
                          p.pp_microbatches or default_microbatches(p.pp, local, p.pp_schedule), t.z_loss, act_dtype,
                          applied_chunk_size(mesh.tp is not None, t.loss_chunk_size))
