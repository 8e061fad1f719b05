"""train.float8: the blocks' Linear layers as torchao's float8 training modules (Float8Linear).

    tensorwise  one scale per tensor (input, weight, output gradient), e4m3 forward and e5m2
                gradients; FSDP2 all-gathers the weights in float8 (half of bf16's bytes) with
                the scale of each weight precomputed for all of them in one all-reduce after
                every optimizer step (precompute_scales).
    rowwise     one scale per row of each operand, e4m3 everywhere, scales rounded to powers
                of 2: closer to bf16's loss, a little slower; torchao refuses the float8
                all-gather for it (enable_fsdp_float8_all_gather needs one scale per tensor,
                which a shard alone cannot know for a row), so its weights travel in bf16.

What changes is the matmuls: the parameters stay plain fp32 master weights with the same names,
so the optimizer, the state dict, DCP checkpoints and hf.py export see the same tensors with
float8 on or off (under the float8 all-gather each weight is a torchao tensor subclass that
reports its fp32 dtype and saves as a plain tensor). The output projection (the module whose weight
is declared Role.READOUT, nn/roles.py) stays out (torchtitan and OLMo-core keep it in bf16: it sets
the logits' precision), and so does any Linear whose in or out features are not multiples of 16
(torch._scaled_mm's constraint).

A mixture of experts: attention, the shared experts and the dense feed-forwards of the first
layers (model.moe_first_dense) are Linear layers and run in float8; each MoE router (Role.ROUTER)
stays out, as DeepSeek-V3 keeps its gate in high precision (its scores pick the experts), and the
routed experts (GroupedExperts, 3-D parameters through nn/grouped_mm.py) are no Linear and stay in
the training dtype: torchao's float8 grouped matmul (torchao.prototype.moe_training) is CUDA-only
and not wired in until a GPU checks it.
Source: torchao.float8 (pytorch/ao, torchao/float8/README.md), torchtitan's float8 converter.
"""
from __future__ import annotations

import functools
import logging
import os

import torch

from core.errors import SetupError, require
from nn.roles import Role, roles

RECIPES = ("tensorwise", "rowwise")


def check(recipe: str, device: torch.device) -> None:
    """The float8 checks of the machine, before any collective: raises a UserError naming the field and the fix.

    recipe: train.float8. MissingPackageError without torchao (the float8 extra); SetupError
    on a CUDA GPU older than compute capability 8.9 (float8 matmuls need Ada/Hopper or newer).
    On a CPU it trains, and rank 0 prints cpu_notice's line once (the matmuls are emulated).
    What float8 does not run with (parallel.tp > 1, parallel.pp > 1) is composition.TABLE's.
    """
    if recipe == "off":
        return
    _import_torchao()
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise SetupError(f"train.float8 {recipe} needs float8 matmuls (compute capability 8.9 or newer: H100, "
                         f"H200, L40S, B200); {name} has {torch.cuda.get_device_capability(device)}; use "
                         f"--train.float8 off")
    note = cpu_notice(recipe, device)
    if note and int(os.environ.get("RANK", 0)) == 0:
        print(note, flush=True)


def cpu_notice(recipe: str, device: torch.device) -> str:
    """The start-up notice for float8 on a CPU (one line), '' on other devices or with float8 off.

    A CPU has no float8 matmul units: torchao's modules run through torch._scaled_mm's CPU
    kernel, which computes the float8 rounding (the numerics the tests check) but gains no
    speed: the debug run measured about 0.6x the tokens/s of the same run with float8 off on an
    AVX2 CPU, and under 0.01x (20 against 2,500 tokens/s) on one with AVX-512 and AMX, where torch
    2.13's kernel takes a slow path (tests/test_float8.py times it).
    """
    if recipe == "off" or device.type != "cpu":
        return ""
    return (f"[train] notice: train.float8 {recipe} on a CPU only emulates the float8 matmuls (float8 numerics, "
            f"no speed-up: 0.6x the speed of --train.float8 off on some CPUs, under 0.01x on others); its speed "
            f"needs a GPU of compute capability 8.9 or newer")


class _DropMessages(logging.Filter):
    """A logger filter that drops the records whose message holds one of fragments; every other record passes."""

    def __init__(self, *fragments: str):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(f in record.getMessage() for f in self.fragments)


_QUIET = _DropMessages(f"{os.sep}torchao{os.sep}_C", "is an Enum subclass and is now natively supported")


def quiet_torchao_logs() -> None:
    """Drop two kinds of log lines that importing torchao (so also transformers' LlamaForCausalLM) prints, by text.

    torchao 0.18 warns 'Failed to load .../torchao/_C_*.so' for each CUDA kernel library it cannot
    load (all of them on a CPU build of torch), and torch's pytree warns that registering an Enum
    (torchao's KernelPreference, ScaleCalculationMode) the old way is deprecated. Float8 training
    needs none of those kernels and the Enums work either way; neither is ours to fix. Every other
    record of those loggers still prints. Idempotent; tests/conftest.py calls it too.
    """
    for name in ("torchao", "torch.utils._pytree"):
        logger = logging.getLogger(name)
        if _QUIET not in logger.filters:
            logger.addFilter(_QUIET)


def _import_torchao():
    quiet_torchao_logs()
    require("torchao", "float8", "train.float8")
    return require("torchao.float8", "float8", "train.float8")  # an old torchao lacks it


HIGH_PRECISION = (Role.READOUT, Role.ROUTER)
"""The roles whose Linear layers stay out of float8 (module docstring): the readout and the MoE routers."""


def held_out(model: torch.nn.Module) -> dict[str, Role]:
    """{module name: role} of the modules whose weight is declared one of HIGH_PRECISION (nn/roles.py), kept out of
    float8: 'output' -> Role.READOUT, 'layers.1.feed_forward.router' -> Role.ROUTER."""
    return {name.rpartition(".")[0]: role for name, role in roles(model, strict=False).items()
            if role in HIGH_PRECISION}


def convertible(module: torch.nn.Module, name: str, excluded: set[str] = frozenset()) -> bool:
    """Whether the Linear `name` becomes a Float8Linear: not in excluded (held_out's), both dims multiples of 16."""
    if not isinstance(module, torch.nn.Linear):
        return True  # torchao asks about every module on its way down; only Linear layers are swapped
    return name not in excluded and module.in_features % 16 == 0 and module.out_features % 16 == 0


def float8_params(model: torch.nn.Module) -> int:
    """Weights (elements) of the Linear layers convert() swaps for Float8Linear: every Linear that is convertible and
    not held out. A token's forward and backward through them is 6 x this many FLOPs at the float8 rate; the rest of
    model.flops_per_token (attention's scores, the readout, the routers, the routed experts' grouped matmuls) runs
    in the training dtype. Reads shapes only: model may be on the meta device, and torchao need not be installed."""
    keep = functools.partial(convertible, excluded=set(held_out(model)))
    return sum(m.weight.numel() for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and keep(m, name))


def convert(model: torch.nn.Module, recipe: str) -> list[str]:
    """Swap the model's eligible nn.Linear layers for torchao Float8Linear in place; returns the Linear layers kept.

    recipe: 'tensorwise' (with FSDP2's float8 all-gather) or 'rowwise'. Works on the meta
    device (before to_empty): the swap keeps each module's name and its weight Parameter.
    Returns the names of the Linear layers left in high precision for the start-up line: the
    output projection, and those whose dims are not multiples of 16. The MoE routers stay out
    too but are not listed (one per MoE layer): describe names them with the routed experts.
    """
    ao = _import_torchao()
    if recipe == "tensorwise":
        config = ao.Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    else:  # the float8 all-gather needs tensorwise scales (torchao asserts it)
        config = ao.Float8LinearConfig.from_recipe_name(recipe)
    held = held_out(model)
    keep = functools.partial(convertible, excluded=set(held))
    kept = [name for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and not keep(m, name) and held.get(name) is not Role.ROUTER]
    ao.convert_to_float8_training(model, config=config, module_filter_fn=keep)
    return kept


def converted(model: torch.nn.Module) -> list[str]:
    """Names of the model's Float8Linear modules (empty when float8 is off or torchao is absent)."""
    try:
        from torchao.float8.float8_linear import Float8Linear
    except ImportError:
        return []
    return [name for name, m in model.named_modules() if isinstance(m, Float8Linear)]


def precompute_scales(model: torch.nn.Module) -> None:
    """After an optimizer step: every float8-all-gathered weight's scale in one all-reduce (tensorwise only).

    Without it each weight's scale would be found at its all-gather, one all-reduce per layer.
    A no-op for models without the float8 all-gather (rowwise, off). Collective over the
    weights' mesh.
    """
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
    precompute_float8_dynamic_scale_for_fsdp(model)


def describe(recipe: str, kept: list[str], moe_layers: int = 0) -> str:
    """The start-up line's words: the recipe, the all-gather, the Linear layers left in high precision, and with
    moe_layers MoE feed-forwards, that their routers and routed experts stay in the training dtype."""
    gather = "float8 all-gather" if recipe == "tensorwise" else "bf16/fp32 all-gather"
    line = f"[train] float8 {recipe} ({gather}); kept in high precision: {', '.join(kept) or 'none'}"
    if moe_layers:
        line += (f"; in the training dtype: the routers and routed experts of {moe_layers} MoE "
                 f"layer{'s' if moe_layers > 1 else ''}")
    return line


def plain_state_dict(state: dict) -> dict:
    """state (a model state dict) with every float8-all-gather weight as the plain fp32 tensor it wraps.

    Under tensorwise each converted weight is a DTensor whose local shard is torchao's
    WeightWithDynamicFloat8CastTensor; saved as is, DCP would pickle that class, and a
    checkpoint would need torchao (and weights_only loading would refuse it). The plain DTensor
    returned shares the shard's storage, so a DCP load into it writes the parameter.
    Other values are returned as they are; without torchao imported, state itself.
    """
    import sys
    if "torchao.float8" not in sys.modules:
        return state
    from torch.distributed.tensor import DTensor
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    out = {}
    for key, value in state.items():
        local = value._local_tensor if isinstance(value, DTensor) else None
        if isinstance(local, WeightWithDynamicFloat8CastTensor):
            value = DTensor.from_local(local._tensor, value.device_mesh, value.placements, run_check=False,
                                       shape=value.shape, stride=value.stride())
        elif isinstance(value, WeightWithDynamicFloat8CastTensor):
            value = value._tensor
        out[key] = value
    return out
