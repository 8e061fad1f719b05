"""hf.py and evaluate.py against transformers: exported logits, tokenizer, import/export identity,
sharded import into a training session, perplexity, and one-line errors for bad input."""
import json
import math
import os
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import data
import generate
import hf
from config import parse_config
from data_pipeline import tokenizer
from debug_export import debug_run_dir, exported_dir
from hf_format import from_hf_name, hf_model_type
from launch import (
    DEBUG,
    ROOT,
    before_any_collective,
    debug_run,
    debug_run_in_process,
    evaluate_in_process,
    losses,
    metrics,
    prepared_data_dir,
    torchrun,
)
from model import PRESETS, ModelArgs, Transformer
from models import random_model
from ranks import run_ranks

transformers = pytest.importorskip("transformers")

# Non-default eps and theta: an export that dropped either would change the logits.
GQA = dict(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=320, ffn_dim=96, max_seq_len=64,
           norm_eps=1e-6, rope_theta=500_000.0)
TEXTS = ["def main():\n    print('héllo, wörld')  # 🙂\n", "  leading and   inner   spaces\t\ttabs\n\n",
         "unicode: ∑ x² → ∞, 中文, emoji 👩‍💻", "literal specials [EOT] and [BOT] inside", "", " "]


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
    """A tiny byte-level BPE tokenizer trained as prepare.py trains one."""
    corpus = [open(os.path.join(ROOT, f)).read() for f in ("model.py", "data.py", "core/cli.py")]
    path = str(tmp_path_factory.mktemp("tok") / "tokenizer.json")
    tokenizer.train_tokenizer(corpus, 320, 200_000).save(path)
    return path


def load_hf(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def hf_tensors(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, f)))
    return out


MUP = dict(parametrization="mup", base_dim=16)
COMPLETEP = dict(parametrization="completep", base_dim=16, base_n_layers=1)
MUP_MULTS = dict(parametrization="mup", base_dim=16, base_head_dim=4, mup_input_mult=4.0, mup_output_mult=2.0,
                 mup_attn_mult=1.5)
"""mup with every base multiplier away from 1 and a proxy head_dim of 4 (GQA's is 8): each folds into a weight."""


@pytest.mark.parametrize("shape", [GQA, PRESETS["debug"], {**GQA, **MUP}, {**GQA, **COMPLETEP}, {**GQA, **MUP_MULTS}],
                         ids=["gqa", "debug", "mup", "completep", "mup_mults"])
def test_exported_logits_equal_ours_under_transformers(tmp_path, tok_path, shape):
    """The export folds mup/completep's multipliers into the weights: plain LlamaForCausalLM gives our logits."""
    args = ModelArgs(**shape)
    model = random_model(args)
    hf.save_hf(model.state_dict(), args, tok_path, str(tmp_path / "out"))
    ref = load_hf(str(tmp_path / "out"))
    c = ref.config
    assert (c.rms_norm_eps, c.num_key_value_heads, c.tie_word_embeddings) == (args.norm_eps, args.n_kv_heads, False)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab_size, (2, min(args.max_seq_len, 128)), generator=gen)
    with torch.no_grad():
        ours, theirs = model(tokens), ref(tokens).logits
    assert ours.abs().max() > 1.0  # the comparison is not between near-zero logits
    assert (ours - theirs).abs().max().item() <= (1e-5 if "parametrization" in shape else 1e-4)


@pytest.mark.parametrize("shape", [MUP, COMPLETEP, MUP_MULTS], ids=["mup", "completep", "mup_mults"])
def test_an_export_imported_into_its_parametrization_gives_back_its_weights(tmp_path, tok_path, shape):
    """init_from_hf of a mup/completep export into the same parametrization: the run's own weights (the multipliers
    divided back out), so training continues from the same function and the same optimizer geometry."""
    args = ModelArgs(**{**GQA, **shape})
    model = random_model(args)
    hf.save_hf(model.state_dict(), args, tok_path, str(tmp_path / "out"))
    again = Transformer(args)
    hf.load_hf_into(again, str(tmp_path / "out"))
    for k, v in model.state_dict().items():
        torch.testing.assert_close(again.state_dict()[k], v, rtol=1e-6, atol=0, msg=k)


# A mixture of experts per class: Mixtral (softmax, renormalised, routed experts only); GLM-4.5 (sigmoid, with the
# balancing bias on the choice, shared experts, first dense layers, raw or renormalised weights), also under
# completep, whose residual multiplier folds into every expert's w2.
MOE = dict(n_experts=4, experts_per_token=2, expert_ffn_dim=48)
MOE_SHAPES = {
    "mixtral": ("MixtralForCausalLM", {**GQA, **MOE, "moe_score": "softmax"}),
    "glm4_moe": ("Glm4MoeForCausalLM", {**GQA, **MOE, "n_layers": 3, "n_shared_experts": 1, "moe_first_dense": 1}),
    "glm4_moe_raw": ("Glm4MoeForCausalLM", {**GQA, **MOE, "moe_renormalize": False}),
    "glm4_moe_completep": ("Glm4MoeForCausalLM", {**GQA, **MOE, **COMPLETEP, "n_shared_experts": 2}),
}


@pytest.mark.parametrize("kind", list(MOE_SHAPES))
def test_exported_moe_logits_equal_ours_under_transformers(tmp_path, tok_path, kind):
    """An MoE export loads as the plain transformers class and gives our logits; importing it gives back the
    model's weights and routing bias."""
    cls, shape = MOE_SHAPES[kind]
    args = ModelArgs(**shape)
    model = random_model(args)
    biases = [m for n, m in model.named_buffers() if n.endswith("expert_bias")]
    if args.moe_score == "sigmoid":  # a moved bias, as the aux-loss-free balancing leaves it: it changes the choice
        for i, b in enumerate(biases):
            b.copy_(0.2 * torch.randn(b.shape, generator=torch.Generator().manual_seed(i)))
    hf.save_hf(model.state_dict(), args, tok_path, str(tmp_path / "out"))
    ref = load_hf(str(tmp_path / "out"))
    assert type(ref).__name__ == cls
    tokens = torch.randint(0, args.vocab_size, (2, args.max_seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(tokens), ref(tokens).logits
        assert ours.abs().max() > 1.0
        assert (ours - theirs).abs().max().item() <= 1e-4
        if args.moe_score == "sigmoid":  # the comparison sees the bias
            for b in biases:
                b.zero_()
            assert (model(tokens) - theirs).abs().max().item() > 1e-3
    again = Transformer(args)
    hf.load_hf_into(again, str(tmp_path / "out"))
    for k, v in random_model(args).state_dict().items():
        if not k.endswith("expert_bias"):
            torch.testing.assert_close(again.state_dict()[k], v, rtol=1e-6, atol=0, msg=k)
    with torch.no_grad():
        torch.testing.assert_close(again(tokens), theirs, rtol=0, atol=1e-4)


@pytest.mark.parametrize("kind", ["mixtral", "glm4_moe"])
def test_moe_folders_written_by_transformers_import_with_their_logits(tmp_path, tok_path, kind):
    """A Mixtral or GLM-4.5 MoE that transformers itself wrote (save_pretrained): read_hf_folder gives its shape,
    and our model with its weights (and routing bias) computes its logits."""
    common = dict(vocab_size=320, hidden_size=64, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                  max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False, num_experts_per_tok=2)
    rope = {"rope_type": "default", "rope_theta": 500_000.0}
    if kind == "mixtral":
        cfg = transformers.MixtralConfig(**common, intermediate_size=48, num_local_experts=4, rope_parameters=rope)
    else:
        cfg = transformers.Glm4MoeConfig(**common, intermediate_size=96, moe_intermediate_size=48, n_routed_experts=4,
                                         n_shared_experts=1, first_k_dense_replace=1,
                                         rope_parameters={**rope, "partial_rotary_factor": 1.0})
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if name.endswith("norm.weight") else 0.15 * torch.randn_like(p))
        for name, b in theirs.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.2 * torch.randn_like(b))
    folder = str(tmp_path / "from_transformers")
    theirs.save_pretrained(folder)
    shutil.copyfile(tok_path, os.path.join(folder, "tokenizer.json"))
    args, _ = hf.read_hf_folder(folder)
    assert (args.n_experts, args.experts_per_token, args.expert_hidden, args.moe_score) == (
        4, 2, 48, "softmax" if kind == "mixtral" else "sigmoid")
    ours = Transformer(args)
    hf.load_hf_into(ours, folder)
    tokens = torch.randint(0, 320, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = theirs(tokens).logits
        assert want.abs().max() > 1.0
        assert (ours(tokens) - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("shape, words", [
    ({"n_shared_experts": 1}, "which cannot express model.n_shared_experts 1; export a run trained without them, or "
                              "with --model.moe_score sigmoid (a Glm4MoeForCausalLM)"),
    ({"moe_first_dense": 1}, "which cannot express model.moe_first_dense 1;"),
    ({"moe_renormalize": False}, "which cannot express model.moe_renormalize false;"),
    ({"bias": True}, "which cannot express a routing bias, and the balancing bias (model.moe_bias_update_rate) moved "
                     "in layer(s) 0, 1; train with --model.moe_bias_update_rate 0 (balance by --model.moe_aux_loss), "
                     "or with --model.moe_score sigmoid"),
    # Before: only the settings were named, and the export refused again for the bias once they were fixed.
    ({"n_shared_experts": 1, "moe_renormalize": False, "bias": True},
     "which cannot express model.n_shared_experts 1, model.moe_renormalize false, or a routing bias, and the "
     "balancing bias (model.moe_bias_update_rate) moved in layer(s) 0, 1; export a run trained without them and "
     "with --model.moe_bias_update_rate 0 (balance by --model.moe_aux_loss), or with --model.moe_score sigmoid "
     "(a Glm4MoeForCausalLM)"),
], ids=["shared", "first_dense", "raw_weights", "bias", "every_reason"])
def test_what_mixtral_cannot_express_is_refused_at_export(tmp_path, tok_path, shape, words):
    """Softmax routing exports as Mixtral only where Mixtral computes it exactly; otherwise one line that names
    every reason, nothing written: from the weights (save_hf) and from a run's checkpoint (hf.py export)."""
    import torch.distributed.checkpoint as dcp

    from core.cli import to_toml

    shape = dict(shape)
    bias = shape.pop("bias", False)
    cfg = parse_config(["--config", DEBUG])
    cfg.model = ModelArgs(**{**GQA, **MOE, "moe_score": "softmax", **shape})
    cfg.data.seq_len = cfg.model.max_seq_len
    state = Transformer(cfg.model).state_dict()
    if bias:
        for k in state:
            if k.endswith("expert_bias"):
                state[k] = torch.full_like(state[k], 0.01)
    with pytest.raises(hf.HFError) as e:
        hf.save_hf(state, cfg.model, tok_path, str(tmp_path / "out"))
    assert str(e.value).startswith("an export of model.moe_score softmax is a MixtralForCausalLM, ") and words in str(
        e.value), str(e.value)
    assert os.listdir(tmp_path) == []

    run = tmp_path / "run"  # a run of that model: its config, tokenizer and a checkpoint of those weights
    (run / "data").mkdir(parents=True)
    (run / "config.toml").write_text(to_toml(cfg))
    shutil.copyfile(tok_path, run / "data" / "tokenizer.json")
    dcp.save({"app": {"model": state}}, checkpoint_id=str(run / "ckpt"), no_dist=True)
    with pytest.raises(hf.HFError) as e:
        hf.export_checkpoint(str(run), str(tmp_path / "out"), str(run / "ckpt"))
    assert str(e.value).startswith(f"'{run}': an export of model.moe_score softmax is a MixtralForCausalLM, ") and \
        words in str(e.value), str(e.value)
    assert sorted(os.listdir(tmp_path)) == ["run"]


def test_init_from_hf_of_another_model_names_the_flags_and_they_fit(tmp_path, tok_path, monkeypatch, capsys):
    """--init_from_hf of an MoE export into the dense debug run: one line naming every --model.* value to set (the
    experts' included), before any collective, nothing created; those flags, as printed, pass every check. The
    reverse (an MoE run, a dense folder): drop the expert flags, as printed."""

    import train_fsdp
    from launch import refused
    from training.command import check_run

    args = ModelArgs(**{**GQA, **MOE, "moe_score": "softmax"})
    hf.save_hf(random_model(args).state_dict(), args, tok_path, str(tmp_path / "mixtral"))
    hf.save_hf(random_model(ModelArgs(**GQA)).state_dict(), ModelArgs(**GQA), tok_path, str(tmp_path / "dense"))
    monkeypatch.setenv("WORLD_SIZE", "1")
    run = ["--config", DEBUG, "--run_dir", str(tmp_path / "run")]
    with before_any_collective(monkeypatch, 1):
        line = refused(train_fsdp.main, [*run, "--init_from_hf", str(tmp_path / "mixtral")], capsys)
    assert not os.path.exists(tmp_path / "run")
    assert "is another model shape; set --model.dim 64 (config has 128), " in line and \
        "--model.n_experts 4 (config has 0), --model.experts_per_token 2 (config has 0), --model.expert_ffn_dim 48 " \
        "(config has 384), --model.moe_score softmax (config has sigmoid)" in line, line
    pairs = [part.split(" (config has")[0].split() for part in line.split("; set ")[1].split(", ")]
    flags = [w for pair in pairs for w in pair]
    check_run(parse_config([*run, "--init_from_hf", str(tmp_path / "mixtral"), *flags]), 1)

    expert = ("--model.n_experts", "--model.experts_per_token", "--model.expert_ffn_dim", "--model.moe_score")
    dense_flags = [w for pair in pairs if pair[0] not in expert for w in pair]
    with before_any_collective(monkeypatch, 1):
        line = refused(train_fsdp.main, [*run, *flags, "--init_from_hf", str(tmp_path / "dense")], capsys)
    assert line.endswith("is a dense Llama, and this run's model.n_experts is 4; drop --model.n_experts and the other "
                         "expert options, and set --model.ffn_dim 96 (config has 384)"), line
    dense_flags += ["--model.ffn_dim", "96"]
    check_run(parse_config([*run, *dense_flags, "--init_from_hf", str(tmp_path / "dense")]), 1)


def test_tokenizer_round_trips_through_autotokenizer(tmp_path, tok_path):
    from tokenizers import Tokenizer

    args = ModelArgs(**GQA)
    hf.save_hf(random_model(args).state_dict(), args, tok_path, str(tmp_path / "out"))
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    ours = Tokenizer.from_file(tok_path)
    eot = ours.token_to_id("[EOT]")
    assert (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == (eot, eot, ours.token_to_id("[PAD]"))
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert auto(text)["input_ids"] == ids, text
        assert auto.decode(ids) == ours.decode(ids, skip_special_tokens=False) == text


def hf_made_folder(tmp_path, tok_path, args: ModelArgs) -> str:
    """A folder written by transformers itself (save_pretrained), with our tokenizer files."""
    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab_size, hidden_size=args.dim, intermediate_size=args.ffn_dim,
        num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads,
        max_position_embeddings=args.max_seq_len, rms_norm_eps=args.norm_eps, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
    folder = str(tmp_path / "from_transformers")
    model.save_pretrained(folder)
    shutil.copyfile(tok_path, os.path.join(folder, "tokenizer.json"))
    return folder


def test_import_then_export_is_the_identity(tmp_path, tok_path):
    args = ModelArgs(**GQA)
    src = hf_made_folder(tmp_path, tok_path, args)
    assert hf.read_hf_folder(src)[0] == args
    model = Transformer(args)
    hf.load_hf_into(model, src)
    hf.save_hf(model.state_dict(), args, hf.tokenizer_path(src), str(tmp_path / "once"), max_shard_size=40_000)
    assert os.path.isfile(tmp_path / "once" / "model.safetensors.index.json")  # sharded
    again = Transformer(args)
    hf.load_hf_into(again, str(tmp_path / "once"))  # import from the sharded folder
    hf.save_hf(again.state_dict(), args, tok_path, str(tmp_path / "twice"))
    original, once, twice = hf_tensors(src), hf_tensors(str(tmp_path / "once")), hf_tensors(str(tmp_path / "twice"))
    assert original.keys() == once.keys() == twice.keys()
    for k in original:
        assert torch.equal(original[k], once[k]) and torch.equal(original[k], twice[k]), k
    c1, c2 = load_hf(src).config, load_hf(str(tmp_path / "twice")).config
    for k in ("hidden_size", "num_key_value_heads", "rms_norm_eps", "vocab_size", "tie_word_embeddings"):
        assert getattr(c1, k) == getattr(c2, k), k
    assert c1.rope_parameters["rope_theta"] == c2.rope_parameters["rope_theta"] == args.rope_theta


@pytest.mark.parametrize("shape, extra", [(GQA, "model.layers.2.input_layernorm.weight"),
                                          (MOE_SHAPES["glm4_moe"][1], "model.layers.0.mlp.gate.weight")],
                         ids=["dense", "moe"])
def test_each_pipeline_stage_imports_its_part_and_the_folder_is_checked_whole(tmp_path, tok_path, shape, extra):
    """load_hf_into on one pipeline stage's part of the model (prune, as at pp 2) fills it with the weights the whole
    model gets (before: the first stage refused the folder, "tensor for 'output.weight' has no parameter"). A folder
    that lacks another stage's weight, or holds one the whole model lacks (a third layer; a router for the dense
    layer 0), is still refused on every stage."""
    from safetensors.torch import save_file

    from parallel.pipeline_stages import prune

    args = ModelArgs(**shape)
    folder = str(tmp_path / "out")
    hf.save_hf(random_model(args).state_dict(), args, tok_path, folder)
    whole = Transformer(args)
    hf.load_hf_into(whole, folder)
    want = whole.state_dict()
    tensors = hf_tensors(folder)
    bad = {}
    for name, changed in (("lacks", {k: v for k, v in tensors.items() if k != "model.norm.weight"}),
                          ("extra", {**tensors, extra: torch.zeros(args.dim if "norm" in extra else
                                                                   (args.n_experts, args.dim))})):
        bad[name] = shutil.copytree(folder, tmp_path / name)
        save_file(changed, os.path.join(bad[name], "model.safetensors"), metadata={"format": "pt"})
    for stage in range(2):
        part = Transformer(args)
        prune(part, [stage], 2)
        hf.load_hf_into(part, folder)
        got = part.state_dict()
        assert got and set(got) < set(want)
        for k, v in got.items():
            assert torch.equal(v, want[k]), (stage, k)
        with pytest.raises(hf.HFError, match=r"lacks 1 weights, e\.g\. model\.norm\.weight$"):
            hf.load_hf_into(part, str(bad["lacks"]))
        with pytest.raises(hf.HFError, match=f"tensor for '{from_hf_name(extra, hf_model_type(args))[0]}' has no "
                                             "parameter in the model"):
            hf.load_hf_into(part, str(bad["extra"]))


@pytest.mark.slow
def test_checkpoint_export_and_sharded_export_match_our_model(tmp_path_factory, tmp_path):
    run = debug_run_dir(tmp_path_factory)
    ours, _ = generate.load_model(run)
    tokens = torch.randint(0, ours.args.vocab_size, (2, 128), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = ours(tokens)
    assert hf.main(["export", "--run_dir", run, "--out", str(tmp_path / "bf16"), "--dtype", "bfloat16",
                    "--max_shard_size", "2MB"]) == 0
    with open(tmp_path / "bf16" / "model.safetensors.index.json") as f:
        assert len(set(json.load(f)["weight_map"].values())) > 1
    for folder, tol in ((exported_dir(tmp_path_factory), 1e-4), (str(tmp_path / "bf16"), 0.1)):
        with torch.no_grad():
            got = load_hf(folder)(tokens).logits
        assert (got - expected).abs().max().item() <= tol, folder


@pytest.mark.slow
def test_import_into_a_sharded_training_session(tmp_path_factory, tmp_path):
    """The init_from_hf wiring: build the FSDP session, load_hf_into with copy_sharded, train from it. The trainer
    started from the export at pp 2 x tp 2 (train_2d.py), each stage loading its own TP shards of its own layers,
    takes its first step from the loss transformers computes on that batch."""
    folder = exported_dir(tmp_path_factory)
    prepared_data_dir(tmp_path / "run")
    out = tmp_path / "worker.pt"
    run_ranks(2, "hf_import_worker", "--hf", folder, "--out", str(out), "--config", DEBUG, "--run_dir",
              str(tmp_path / "run"), timeout=180)
    res = torch.load(out)
    assert res["max_diff"] == 0.0
    assert res["inputs"].shape == (_debug_cfg().train.global_batch_size, _debug_cfg().data.seq_len)
    with torch.no_grad():
        logits = load_hf(folder)(res["inputs"]).logits
    loss = F.cross_entropy(logits.flatten(0, 1), res["labels"].flatten()).item()
    assert abs(res["loss"] - loss) < 1e-5
    # The trainer's step 1 runs the same first global batch (same seed and corpus) through the pipeline.
    rd = tmp_path / "pp2-tp2"
    prepared_data_dir(rd)
    debug_run(4, rd, "--parallel.pp", "2", "--parallel.tp", "2", "--init_from_hf", folder, "--train.steps", "1",
              "--train.val_interval", "0", "--checkpoint.interval", "1000", script="train_2d.py", timeout=300)
    assert losses(rd)[1] == pytest.approx(loss, rel=1e-5, abs=0)


# Softmax routing that Mixtral computes: no balancing bias (the remedy hf.py prints: --model.moe_bias_update_rate 0),
# balanced by the auxiliary loss instead.
MIXTRAL_FLAGS = ["--model.n_experts", "4", "--model.experts_per_token", "2", "--model.moe_score", "softmax",
                 "--model.moe_bias_update_rate", "0", "--model.moe_aux_loss", "0.01", "--train.val_interval", "0"]


@pytest.mark.slow
def test_moe_export_computes_our_logits_and_init_from_hf_continues_with_the_same_losses(tmp_path, monkeypatch, capsys):
    """hf.py export of a trained Mixtral-style run: MixtralForCausalLM's logits are ours. --init_from_hf of an
    export of the run's initial weights, at ep 2, trains as the run itself did from them: the same losses."""
    run, cont = tmp_path / "run", tmp_path / "continued"
    prepared_data_dir(run)
    debug_run_in_process(monkeypatch, capsys, run, *MIXTRAL_FLAGS, "--train.steps", "3", "--checkpoint.interval", "3")
    assert hf.main(["export", "--run_dir", str(run), "--out", str(tmp_path / "mixtral")]) == 0
    ours, _ = generate.load_model(str(run))
    ref = load_hf(str(tmp_path / "mixtral"))
    assert type(ref).__name__ == "MixtralForCausalLM"
    tokens = torch.randint(0, ours.args.vocab_size, (2, 128), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (ours(tokens) - ref(tokens).logits).abs().max().item() <= 1e-4

    cfg = parse_config(["--config", DEBUG, *MIXTRAL_FLAGS])
    start = Transformer(cfg.model)
    start.init_weights(cfg.train.seed)  # the run's weights at step 0 (init does not depend on the layout)
    hf.save_hf(start.state_dict(), cfg.model, str(run / "data" / "tokenizer.json"), str(tmp_path / "step0"))
    prepared_data_dir(cont)
    # Imported at ep 2 (each rank keeps its experts' shards): the 1-rank run's losses, as every MoE layout gives them.
    debug_run(2, cont, *MIXTRAL_FLAGS, "--parallel.ep", "2", "--train.steps", "3", "--checkpoint.interval", "1000",
              "--init_from_hf", str(tmp_path / "step0"))
    want, got = losses(run), losses(cont)
    assert sorted(got) == sorted(want) == [1, 2, 3]
    assert got == pytest.approx(want, rel=1e-5, abs=0)


def _without_checkpoints(run, tmp_path) -> str:
    """A copy of run's config and data, without its checkpoints."""
    bare = tmp_path / "bare_run"
    bare.mkdir()
    shutil.copyfile(os.path.join(run, "config.toml"), bare / "config.toml")
    shutil.copytree(os.path.join(run, "data"), bare / "data")
    return str(bare)


def _debug_cfg():
    return parse_config(["--config", DEBUG])


@pytest.mark.slow
def test_perplexity_of_evaluate_equals_transformers_on_the_same_windows(tmp_path_factory):
    run = debug_run_dir(tmp_path_factory)
    cfg = _debug_cfg()
    n = cfg.train.val_batches * cfg.train.global_batch_size  # the windows training validates on
    # 5 per forward on 2 ranks: uneven last batches, and one rank runs a spare forward.
    # under torchrun, as a user launches it: evaluate.py's one such launch in the suite (the others fork: launch.run)
    proc = torchrun(2, "evaluate.py", "--run_dir", run, "--split", "val", "--max_sequences", str(n),
                    "--micro_batch_size", "5", timeout=180)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    corpus = data.PackedCorpus(os.path.join(run, "data"), cfg.data)
    assert corpus.n_val >= n
    windows = torch.from_numpy(np.stack([corpus.sample(corpus.n_train + i) for i in range(n)]))
    ref = load_hf(exported_dir(tmp_path_factory))
    with torch.no_grad():
        logits = torch.cat([ref(w[:, :-1]).logits for w in windows.split(16)])
    losses = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten(), reduction="none").double()
    assert result["tokens"] == losses.numel() == n * cfg.data.seq_len
    assert abs(result["loss"] - losses.mean().item()) < 1e-5
    assert math.isclose(result["ppl"], math.exp(losses.mean().item()), rel_tol=1e-5)
    # ... and training's own validation loss at its last step.
    assert abs(result["loss"] - [r["val_loss"] for r in metrics(run) if "val_loss" in r][-1]) < 1e-5


def _error_line(main, argv, capsys) -> str:
    """The command's stderr when it refuses argv: exit status 2 and one line 'error: ...'."""
    capsys.readouterr()
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.mark.slow
def test_bad_input_gives_one_line_errors(tmp_path, tmp_path_factory, tok_path, capsys):
    import evaluate
    import generate

    run = debug_run_dir(tmp_path_factory)
    nope = str(tmp_path / "nope")
    assert "no config.toml" in _error_line(hf.main, ["export", "--run_dir", nope, "--out", "x"], capsys)
    assert ".metadata" in _error_line(hf.main, ["export", "--run_dir", run, "--checkpoint", str(tmp_path),
                                                "--out", str(tmp_path / "x")], capsys)
    assert "not empty" in _error_line(hf.main, ["export", "--run_dir", run, "--out", exported_dir(tmp_path_factory)],
                                      capsys)
    assert "no config.toml" in _error_line(evaluate.main, ["--run_dir", str(tmp_path)], capsys)
    assert "no complete checkpoint" in _error_line(generate.main, ["--run_dir", _without_checkpoints(run, tmp_path)],
                                                   capsys)
    assert "not a directory" in _error_line(generate.main, ["--hf", str(tmp_path / "nope")], capsys)

    args = ModelArgs(**GQA)
    with pytest.raises(hf.HFError, match="no config.json"):
        hf.load_hf_into(Transformer(args), str(tmp_path))
    src = hf_made_folder(tmp_path, tok_path, args)
    with pytest.raises(hf.HFError, match=r"--model.n_kv_heads 2"):
        hf.load_hf_into(Transformer(ModelArgs(**{**GQA, "n_kv_heads": 4})), src)
    cfg = json.load(open(os.path.join(src, "config.json")))
    json.dump({**cfg, "model_type": "gpt2"}, open(os.path.join(src, "config.json"), "w"))
    with pytest.raises(hf.HFError, match="not 'llama'"):
        hf.read_hf_folder(src)
    for bad, words in (({"hidden_size": 128.0}, "hidden_size=128.0"), ({"rope_parameters": "x"}, "rope_parameters")):
        json.dump({**cfg, **bad}, open(os.path.join(src, "config.json"), "w"))
        with pytest.raises(hf.HFError, match=words):
            hf.read_hf_folder(src)
    # A weight whose shape disagrees with a consistent config is named.
    json.dump(cfg, open(os.path.join(src, "config.json"), "w"))
    from safetensors.torch import save_file

    tensors = hf_tensors(src)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, os.path.join(src, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(hf.HFError, match=r"model\.layers\.1\.mlp\.up_proj\.weight has shape \(3, 3\)"):
        hf.load_hf_into(Transformer(args), src)
    with pytest.raises(hf.HFError, match="output.weight: None"):
        sd = Transformer(args).state_dict()
        del sd["output.weight"]
        hf.save_hf(sd, args, tok_path, str(tmp_path / "partial"))


@pytest.mark.slow
def test_an_empty_split_is_refused_and_split_all_evaluates(tmp_path_factory, tmp_path, monkeypatch, capsys):
    """'use --split all' as printed evaluates every window; a run whose tokens were removed is tokenized again."""
    run = debug_run_dir(tmp_path_factory)

    def evaluate(run_dir, *args, check=True):  # the first 32 windows of a split: the same ones for 'all' either way
        # In this process (evaluate.main, 1 rank): the 2-rank launch is test_perplexity_of_evaluate_...'s.
        rc, result, err = evaluate_in_process(monkeypatch, capsys, "--run_dir", run_dir, "--max_sequences", "32",
                                              *args)
        if check:
            assert rc == 0, err
        return result if check else (rc, err)

    rc, err = evaluate(run, "--split", "val", "--data.val_fraction", "0", check=False)
    assert rc == 2 and "use --split all or raise --data.val_fraction" in err, err
    got = evaluate(run, "--split", "all", "--data.val_fraction", "0")
    want = evaluate(run, "--split", "all")
    assert got["tokens"] == want["tokens"] and abs(got["loss"] - want["loss"]) <= 1e-6 * want["loss"]
    bare = tmp_path / "no_tokens"
    shutil.copytree(run, bare, ignore=shutil.ignore_patterns("eval_data"))
    for name in os.listdir(bare / "data"):
        if name != "tokenizer.json":
            p = bare / "data" / name
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    again = evaluate(str(bare), "--split", "all")
    assert again["tokens"] == want["tokens"] and abs(again["loss"] - want["loss"]) <= 1e-6 * want["loss"]


@pytest.mark.slow
def test_init_from_hf_into_data_prepared_with_the_same_tokenizer(tmp_path_factory, tmp_path, monkeypatch, capsys):
    """data/ prepared without data.tokenizer, with the export's own tokenizer: accepted (before: 'prepared with other
    data settings'); one step trains from the export's weights."""
    rd = tmp_path / "continued"
    prepared_data_dir(rd)  # the debug corpus, tokenized with the tokenizer the exported run used
    # 1-rank runs, train_fsdp.main in this process.
    proc = debug_run_in_process(monkeypatch, capsys, rd, "--init_from_hf", exported_dir(tmp_path_factory),
                                "--train.steps", "1", "--checkpoint.interval", "1000")
    assert f"weights from {exported_dir(tmp_path_factory)}" in proc.stdout
    assert parse_config(["--config", str(rd / "config.toml")]).data.tokenizer == ""
    # The same command again: the run's own checkpoint wins, and the start says the flag was not used.
    proc = debug_run_in_process(monkeypatch, capsys, rd, "--init_from_hf", exported_dir(tmp_path_factory),
                                "--train.steps", "1", "--checkpoint.interval", "1000")
    assert "step_00000001, not --init_from_hf" in proc.stdout and "nothing to run" in proc.stdout, proc.stdout
