"""Every parameter and buffer of every kind of model has exactly one declared role (nn/roles.py), the one the names
used to imply; a tensor without a role, or with two, is refused."""
import itertools

import pytest
import torch

import model as model_module
from model import PRESETS, ModelArgs, Transformer
from nn.roles import Role, declarations, roles
from parallel.pipeline_stages import prune

PARAMETRIZATIONS = {"sp": {}, "mup": dict(parametrization="mup", base_dim=64),
                    "completep": dict(parametrization="completep", base_dim=64, base_n_layers=2)}
SHAPES = {"dense": {}, "moe": dict(n_experts=4, experts_per_token=2),
          "moe_shared_first_dense": dict(n_experts=4, experts_per_token=2, n_shared_experts=1, moe_first_dense=1,
                                         expert_ffn_dim=64, moe_score="softmax")}


def build(shape: str, parametrization: str) -> Transformer:
    with torch.device("meta"):  # shapes only: the roles do not depend on the values
        return Transformer(ModelArgs(**{**PRESETS["debug"], **SHAPES[shape], **PARAMETRIZATIONS[parametrization]}))


def role_by_name(name: str) -> Role:
    """The role that the name suffixes gave before roles were declared (the rules of nn/parametrization.py then)."""
    local = name.split(".", 2)[-1] if name.startswith("layers.") else name
    table = {"tok_embeddings.weight": Role.EMBEDDING, "output.weight": Role.READOUT, "norm.weight": Role.NORM,
             "rope_cos": Role.BUFFER, "rope_sin": Role.BUFFER, "attention_norm.weight": Role.NORM,
             "ffn_norm.weight": Role.NORM, "attention.wq.weight": Role.QUERY, "attention.wo.weight": Role.RESIDUAL,
             "feed_forward.router.weight": Role.ROUTER, "feed_forward.expert_bias": Role.BUFFER,
             "feed_forward.experts.w2": Role.EXPERTS_RESIDUAL, "feed_forward.w2.weight": Role.RESIDUAL,
             "feed_forward.shared_experts.w2.weight": Role.RESIDUAL}
    if local in table:
        return table[local]
    return Role.EXPERTS if local.startswith("feed_forward.experts.") else Role.HIDDEN


@pytest.mark.parametrize("shape, parametrization", itertools.product(SHAPES, PARAMETRIZATIONS))
def test_every_parameter_and_buffer_has_exactly_one_role(shape, parametrization):
    model = build(shape, parametrization)
    held = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    declared = [n for n, _ in declarations(model)]
    assert sorted(declared) == sorted(held), "each tensor declared once, nothing else"
    assert {n: role_by_name(n) for n in held} == roles(model)
    state = model.state_dict()  # the persistent buffers (the MoE's expert_bias) are checkpointed: roles cover them
    assert set(state) <= set(roles(model)) and any(r is Role.BUFFER for r in roles(model).values())
    for module in model.modules():  # init_weights fills a buffer through its module's own reset
        if Role.BUFFER in getattr(type(module), "ROLES", {}).values():
            assert callable(getattr(module, "reset_buffers", None)), type(module).__name__


def test_a_pipeline_stage_holds_the_roles_of_its_own_tensors():
    model = build("moe_shared_first_dense", "mup")
    whole = roles(model)
    prune(model, [1], 2)  # the second of two stages: no embedding, the last blocks, the norm and the output
    part = roles(model)
    assert part and set(part) < set(whole) and all(whole[n] is r for n, r in part.items())
    assert "tok_embeddings.weight" not in part and part["output.weight"] is Role.READOUT


def test_a_tensor_without_a_role_or_with_two_is_refused(monkeypatch):
    model = build("dense", "sp")
    model.layers[0].attention.extra = torch.nn.Parameter(torch.zeros(2, device="meta"))
    with pytest.raises(ValueError, match="no role: layers.0.attention.extra; each tensor needs exactly one entry"):
        roles(model)
    assert "layers.0.attention.extra" not in roles(model, strict=False)
    del model.layers[0].attention.extra
    monkeypatch.setattr(model_module.TransformerBlock, "ROLES", {"attention.wq.weight": Role.HIDDEN}, raising=False)
    with pytest.raises(ValueError, match=r"declared twice: layers.0.attention.wq.weight, layers.1.attention.wq"):
        roles(model)


def test_the_model_refuses_to_build_or_init_with_an_undeclared_parameter(monkeypatch):
    model = Transformer(ModelArgs(**{**PRESETS["debug"], "n_layers": 1, "vocab_size": 256}))
    model.norm.bias = torch.nn.Parameter(torch.zeros(model.args.dim))
    with pytest.raises(ValueError, match="no role: norm.bias"):
        model.init_weights(seed=0)
    monkeypatch.setattr(model_module.FeedForward, "ROLES", {"w1.weight": Role.HIDDEN, "w3.weight": Role.HIDDEN})
    with pytest.raises(ValueError, match="no role: layers.0.feed_forward.w2.weight"):
        Transformer(ModelArgs(**{**PRESETS["debug"], "n_layers": 1, "vocab_size": 256}))
