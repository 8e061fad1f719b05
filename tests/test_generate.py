"""generate.py: the KV-cached forward equals the uncached forward position by position, greedy decoding equals
transformers' generate token for token, the sampling filters equal transformers' warpers, and a
checkpoint exported with the documented command generates through plain transformers."""
import json
import os
import subprocess
import sys

import pytest
import torch

import generate
import hf
from data_pipeline.tokenizer import train_tokenizer
from debug_export import debug_run_dir, exported_dir
from launch import ROOT
from model import ModelArgs
from models import random_model

transformers = pytest.importorskip("transformers")

GQA = dict(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=97, ffn_dim=96, max_seq_len=64,
           norm_eps=1e-6, rope_theta=500_000.0)


MHA = {**GQA, "n_kv_heads": 8}


@pytest.mark.parametrize("shape", [GQA, MHA, {**GQA, "document_mask": True}], ids=["gqa", "mha", "document_mask"])
def test_cached_logits_equal_the_full_forward_position_by_position(shape):
    """The reference is the model's uncached forward (the training path) over the whole sequence."""
    model = random_model(ModelArgs(**shape))
    tokens = torch.randint(3, 97, (2, 40), generator=torch.Generator().manual_seed(0))
    tokens[:, 0] = 2  # [EOT] starts the document, as in generate.py (the only one: document_mask is causal here)
    with torch.no_grad():
        want = model(tokens)
        cache = model.kv_cache(2, 64)
        # A prompt in two chunks (the second attends to the first through the cache), then one token at a time.
        got = [model(tokens[:, :20], cache=cache), model(tokens[:, 20:30], cache=cache, start=20)]
        got += [model(tokens[:, pos:pos + 1], cache=cache, start=pos) for pos in range(30, 40)]
        got = torch.cat(got, dim=1)
    assert got.shape == want.shape == (2, 40, 97)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(tokens[:, :30], cache=cache, start=40)
    with pytest.raises(ValueError, match="KV cache length"):
        model(tokens[:, :10], cache=model.kv_cache(2, 32), start=30)


def test_greedy_generation_equals_transformers(tmp_path):
    args = ModelArgs(**{**GQA, "vocab_size": 320})
    model = random_model(args, seed=3)
    tok = str(tmp_path / "tokenizer.json")
    train_tokenizer([open(os.path.join(ROOT, "model.py")).read()], 320, 100_000).save(tok)
    hf.save_hf(model.state_dict(), args, tok, str(tmp_path / "hf"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    for prompt in ([2], [2, 17, 250, 31, 99, 5]):
        ours = generate.generate(model, prompt, 50, temperature=0)
        theirs = ref.generate(torch.tensor([prompt]), max_new_tokens=50, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
        assert ours == theirs
        assert len(set(ours)) > 5  # not one token repeated: the comparison has content


def test_sampling_filters_equal_transformers_warpers():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(4, 200, generator=torch.Generator().manual_seed(0)) * 3
    for t, k, p in ((0.7, 0, 0.9), (1.3, 20, 1.0), (1.0, 50, 0.5), (0.5, 5, 0.95)):
        ours = generate.warp_logits(logits, t, k, p)
        theirs = TemperatureLogitsWarper(t)(None, logits.clone())
        if k:
            theirs = TopKLogitsWarper(k)(None, theirs)
        if p < 1:
            theirs = TopPLogitsWarper(p)(None, theirs)
        assert torch.equal(ours.isinf(), theirs.isinf()), (t, k, p)
        torch.testing.assert_close(ours[~ours.isinf()], theirs[~theirs.isinf()])


def test_sampling_is_seeded_and_respects_top_k():
    model = random_model(ModelArgs(**GQA))
    greedy = generate.generate(model, [2, 5], 20, temperature=0)
    assert generate.generate(model, [2, 5], 20, temperature=1.0, top_k=1, seed=4) == greedy
    a = generate.generate(model, [2, 5], 20, temperature=1.0, seed=1)
    assert a == generate.generate(model, [2, 5], 20, temperature=1.0, seed=1)
    assert a != generate.generate(model, [2, 5], 20, temperature=1.0, seed=2)
    logits = torch.randn(1, 97)
    top3 = set(logits[0].topk(3).indices.tolist())
    gen = torch.Generator().manual_seed(0)
    assert {int(generate.sample_next(logits, 1.0, 3, 1.0, gen)) for _ in range(200)} == top3
    stop = generate.generate(model, [2, 5], 20, temperature=0, stop_ids=(greedy[3],))
    assert stop == greedy[:greedy.index(greedy[3]) + 1]
    with pytest.raises(ValueError, match="max_seq_len"):
        generate.generate(model, [2] * 10, 60)
    with pytest.raises(ValueError, match="empty"):
        generate.generate(model, [], 5)


_PLAIN_TRANSFORMERS = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
folder, prompt = sys.argv[1], sys.argv[2]
tok = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder)
ids = tok(tok.bos_token + prompt, return_tensors="pt").input_ids
out = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id)
print(json.dumps({"ids": out[0].tolist(), "text": tok.decode(out[0], skip_special_tokens=True)}))
"""


@pytest.mark.slow
def test_exported_checkpoint_generates_through_plain_transformers(tmp_path_factory):
    """The done criterion: `python hf.py export` output runs in a fresh process with transformers only."""
    folder = exported_dir(tmp_path_factory)
    proc = subprocess.run([sys.executable, "-c", _PLAIN_TRANSFORMERS, folder, "def main("], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["text"].startswith("def main(") and len(result["text"]) > len("def main(")
    model, tok_path = generate.load_model(debug_run_dir(tmp_path_factory))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tok_path)
    prompt = [tok.token_to_id("[EOT]")] + tok.encode("def main(").ids
    assert result["ids"][:len(prompt)] == prompt
    ours = generate.generate(model, prompt, 24, temperature=0, stop_ids=(tok.token_to_id("[EOT]"),))
    assert result["ids"][len(prompt):] == ours


@pytest.mark.slow
def test_generate_command_prints_samples(tmp_path_factory, capsys):
    run = debug_run_dir(tmp_path_factory)
    assert generate.main(["--run_dir", run, "--prompt", "import ", "--max_new_tokens", "16", "--num_samples", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("--- sample") == 2 and "\nimport " in out
