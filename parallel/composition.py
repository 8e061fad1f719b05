"""What composes with what, as one table: each row a pair of settings that do not run together yet, why, and the
remedy. config.validate, training/command.check_run and ladder.py check it; docs/cluster.md prints it
(tests/test_docs.py keeps the two equal).

A row is a pair (or a setting under an entry script). What is not a pair stays with its setting: sizes that must
divide (world size, heads, experts over ranks, micro-batches) are the layout checks', and one setting's own
validity (top-1 routing with renormalised weights, parallel.ep of a dense model) compose.check_moe's. The table is
checked before both, so that their remedies (another size, another parallel.ep) never name a pair it refuses; and no
row's remedy is a pair another row refuses (tests/test_composition.py walks every pair of rows).

cfg is a config.Config (duck-typed: this module sits below config.py).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from core.errors import SetupError
from parallel.pipeline_stages import ZERO_BUBBLE


@dataclasses.dataclass(frozen=True)
class Refusal:
    """One row: setting a does not run with setting b yet."""

    a: str
    """The setting that refuses, at the values it refuses ('parallel.pp > 1'), or an entry script."""
    b: str
    """What it does not run with, its name first ('train.loss_chunk_size > 0'): the message names it so."""
    when: Callable[[Any], bool]
    """Whether cfg sets both."""
    why: str
    """Why not, in a phrase (docs/cluster.md)."""
    remedy: str
    """The remedies, as docs/cluster.md words them."""
    fixes: Callable[[Any], list[dict[str, Any]]]
    """Each remedy the error line prints for cfg, as the settings it takes ({'parallel.pp': 1}); an entry script
    is not a setting, so a row whose only remedy is another script has none."""
    say: Callable[[Any, list["Refusal"]], str]
    """The error line for cfg; given the rows with the same say that refuse cfg too, named together (one fix)."""
    script: str = ""
    """The entry script the row belongs to ('train_fsdp.py'), '' for every one."""

    @property
    def name(self) -> str:
        """b's setting, as a message names it."""
        return self.b.split()[0]


def words(fix: dict[str, Any]) -> str:
    """A remedy as the error lines print it: 'train.compile false and parallel.pp 1'; [] is 'no [[name]] tables'."""
    def one(name, value):
        if value == []:
            return f"no [[{name}]] tables"
        return f"{name} {str(value).lower() if isinstance(value, bool) else value}"
    return " and ".join(one(n, v) for n, v in fix.items())


def without_zero_bubble(p) -> dict[str, Any]:
    """The schedule to offer instead of p.pp_schedule, a zero-bubble one, that every other check takes with the same
    stages and micro-batches: Interleaved1F1B for InterleavedZeroBubble (the same rules), 1F1B for the V-shaped ones
    (Interleaved1F1B would refuse some micro-batch counts they take, e.g. 5 at pp 2)."""
    if p.pp_schedule == "InterleavedZeroBubble":
        return {"parallel.pp_schedule": "Interleaved1F1B"}
    return {"parallel.pp_schedule": "1F1B", **({"parallel.pp_stages_per_rank": 0} if p.pp_stages_per_rank else {})}


PP, ZB = "parallel.pp > 1", f"parallel.pp_schedule {' or '.join(ZERO_BUBBLE)}"
TWICE = {"train.activation_checkpointing": "the recompute", "train.compile": "a compiled backward"}
"""What cannot run a zero-bubble schedule's second backward through a micro-batch, by the setting."""


def _pipeline(cfg, rows: list[Refusal]) -> str:
    """The pipeline rows' line: what parallel.pp > 1 refuses, with what its zero-bubble schedule refuses, if any;
    else what the schedule refuses."""
    p = cfg.parallel
    pp, zb = [r for r in rows if r.a == PP], [r for r in rows if r.a == ZB]
    offs = " and ".join(words(r.fixes(cfg)[0]) for r in pp + zb)
    if pp:  # named with the zero-bubble ones, so that one fix is enough
        names = [r.name for r in pp] + [f"{r.name} (under {p.pp_schedule})" for r in zb]
        return (f"parallel.pp {p.pp} does not run with {', '.join(names)} yet (docs/pipeline.md); use {offs}, or "
                f"parallel.pp 1")
    return (f"parallel.pp_schedule {p.pp_schedule} does not run with {', '.join(r.name for r in zb)} yet: its "
            f"weight-gradient pass is a second backward through each micro-batch, which "
            f"{' and '.join(TWICE[r.name] for r in zb)} cannot run (docs/pipeline.md); use {offs}, or "
            f"{words(without_zero_bubble(p))}")


def _pp_row(b: str, on: Callable[[Any], bool], off: dict[str, Any], why: str) -> Refusal:
    """A row of parallel.pp > 1 with b (on: whether cfg sets it; off: the setting that turns it off)."""
    return Refusal(PP, b, lambda c: c.parallel.pp > 1 and on(c), why, f"`{words(off)}`, or `parallel.pp 1`",
                   lambda c: [off, {"parallel.pp": 1}], _pipeline)


def _zb_row(b: str, on: Callable[[Any], bool], off: dict[str, Any]) -> Refusal:
    """A row of a zero-bubble schedule (at parallel.pp > 1) with b; the other schedules take it."""
    # The weight-gradient pass is a second backward through the graph the input-gradient pass already ran: the
    # checkpointed blocks' recompute runs again and its context, made once per forward, cannot be entered twice
    # (AttributeError: '_GeneratorContextManager' object has no attribute 'args'), and a compiled block's backward
    # has donated (freed) the buffers the second pass needs ("compiled with non-empty donated buffers"); with
    # torch._functorch.config.donated_buffer off it trains, to wrong gradients (ZBVZeroBubble at pp 2: step 2's loss
    # 8.3531 against one process's 8.3521, which it matches without compile).
    return Refusal(ZB, b, lambda c: c.parallel.pp > 1 and c.parallel.pp_schedule in ZERO_BUBBLE and on(c),
                   f"its weight-gradient pass is a second backward through each micro-batch, which "
                   f"{TWICE[b.split()[0]]} cannot run", f"`{words(off)}`, or `parallel.pp_schedule Interleaved1F1B` "
                   f"(for InterleavedZeroBubble) or `1F1B` (the V-shaped ones)",
                   lambda c: [off, without_zero_bubble(c.parallel)], _pipeline)


def _ep(c) -> bool:
    """Whether cfg splits a mixture of experts over parallel.ep > 1 ranks."""
    return c.model.n_experts > 0 and c.parallel.ep > 1


TABLE: list[Refusal] = [
    Refusal("train_fsdp.py", "parallel.tp > 1", lambda c: c.parallel.tp > 1, "tensor parallelism is train_2d.py's plan",
            "`train_2d.py`", lambda c: [],
            lambda c, _: f"parallel.tp is {c.parallel.tp}: tensor parallelism runs with train_2d.py",
            script="train_fsdp.py"),
    # EP's rows are of a mixture of experts: parallel.ep of a dense model is compose.check_moe's own refusal.
    # Eager, each pair runs (tests/test_moe.py, and compile with full checkpointing was run once); together, the
    # compiled blocks' recompute replays the experts' all-to-all and its waits in another order than their forward
    # did, and selective checkpointing's replay fails at the first backward (torch 2.13, CPU).
    Refusal("parallel.ep > 1", "train.activation_checkpointing selective with train.compile true",
            lambda c: _ep(c) and c.train.activation_checkpointing == "selective" and c.train.compile,
            "the compiled blocks' recompute replays the experts' all-to-all in another order than their forward, "
            "and the replay fails at the first backward (torch 2.13)",
            "`train.activation_checkpointing full`, or `train.compile false`",
            lambda c: [{"train.activation_checkpointing": "full"}, {"train.compile": False}],
            lambda c, _: f"parallel.ep {c.parallel.ep} does not run with train.activation_checkpointing selective "
                         f"and train.compile true together yet (docs/moe.md); use train.activation_checkpointing "
                         f"full, or train.compile false"),
    # Under TP an MoE's parameters are plain tensors sharded over the data-parallel ranks only (parallel/moe_sequence.py),
    # and the distributed Muon hands out whole matrices over every rank holding the same parameters, which it
    # finds from meshes that span them all (optimization/muon.py).
    Refusal("optim.name muon", "model.n_experts > 0 with parallel.tp > 1",
            lambda c: c.optim.name == "muon" and c.model.n_experts > 0 and c.parallel.tp > 1,
            "the MoE's parameters are sharded over the data-parallel ranks only, not over the TP ranks Muon "
            "hands its matrices to", "`optim.name adamw`, or `parallel.tp 1` (Muon with EP, FSDP or HSDP)",
            lambda c: [{"optim.name": "adamw"}, {"parallel.tp": 1}],
            lambda c, _: f"optim.name muon does not run with a mixture of experts (model.n_experts "
                         f"{c.model.n_experts}) at parallel.tp {c.parallel.tp} yet (docs/moe.md); use optim.name "
                         f"adamw, or parallel.tp 1 with train_fsdp.py"),
    _pp_row("train.float8 tensorwise or rowwise", lambda c: c.train.float8 != "off", {"train.float8": "off"},
            "not built yet"),
    # The stages' receive buffers are sized at the first step: a larger micro-batch later aborts gloo.
    _pp_row("[[train.batch_stages]]", lambda c: bool(c.train.batch_stages), {"train.batch_stages": []},
            "each stage's receive buffers keep the first step's micro-batch shape"),
    _zb_row("train.activation_checkpointing full or selective", lambda c: c.train.activation_checkpointing != "none",
            {"train.activation_checkpointing": "none"}),
    _zb_row("train.compile true", lambda c: c.train.compile, {"train.compile": False}),
    # Downstream scoring runs rows of any length, which are not sliced over the CP ranks.
    Refusal("parallel.cp > 1", "[[eval.tasks]]", lambda c: c.parallel.cp > 1 and bool(c.eval.tasks),
            "the loop scores the tasks' rows whole, not sliced over the CP ranks",
            "no `[[eval.tasks]]`: score the checkpoints with `evaluate.py --tasks`",
            lambda c: [{"eval.tasks": []}],
            lambda c, _: f"[[eval.tasks]] are scored in the loop only at parallel.cp 1 (got {c.parallel.cp}); drop "
                         f"[eval] and score the checkpoints with evaluate.py --tasks"),
    Refusal("train.float8 tensorwise or rowwise", "parallel.tp > 1",
            lambda c: c.train.float8 != "off" and c.parallel.tp > 1,
            "torchao's float8 TP styles are not wired into train_2d.py's plan yet",
            "`parallel.tp 1` (`train_fsdp.py`, FSDP or HSDP), or `train.float8 off`",
            lambda c: [{"parallel.tp": 1}, {"train.float8": "off"}],
            lambda c, _: f"train.float8 {c.train.float8} does not run with parallel.tp {c.parallel.tp} (train_2d.py) "
                         f"yet; use train_fsdp.py with parallel.tp 1 (FSDP or HSDP) for float8, or --train.float8 off "
                         f"under tensor parallelism"),
]
"""Every pair that does not run together yet; when several refuse a config, the first one's line is printed, naming the
others."""


def refusals(cfg, script: str = "") -> list[Refusal]:
    """The rows that refuse cfg, in the table's order; a row of an entry script counts only under that script."""
    return [r for r in TABLE if r.script in ("", script) and r.when(cfg)]


def check_composition(cfg, script: str = "") -> None:
    """Raise SetupError with the first refusing row's line (and the rows it names with it), followed by the other
    pairs that refuse cfg, so that a remedy of the first is not taken for the whole fix; needs no collective.

    script: the entry script that runs cfg ('train_fsdp.py', 'train_2d.py'); '' leaves out the scripts' rows.
    """
    refused = refusals(cfg, script)
    if refused:
        first = refused[0]
        line = first.say(cfg, [r for r in refused if r.say is first.say])
        others = [f"{r.a} with {r.b}" for r in refused if r.say is not first.say]
        if others:
            line += f" (these settings are also refused as {'; '.join(others)}: docs/cluster.md)"
        raise SetupError(line)


def markdown() -> str:
    """The table as docs/cluster.md prints it: a header and one row per refusal."""
    lines = ["| setting | does not run with | why | use instead |", "|---|---|---|---|"]
    lines += [f"| `{r.a}` | `{r.b}` | {r.why} | {r.remedy} |" for r in TABLE]
    return "\n".join(lines)
