"""Document masking and the chunked loss against references in one process: each document run
alone from position 0, plain causal attention, the unchunked loss and its gradients. The same
properties at 2 FSDP ranks and dp1 x tp2 are in test_2d.py."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model import ModelArgs
from models import random_model
from nn.documents import block_causal_mask, document_positions
from nn.loss import chunked_cross_entropy_sum, token_loss_sum

EOT = 2
ARGS = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97, ffn_dim=96, max_seq_len=64)


def packed_window(gen: torch.Generator, lengths: list[int], head: int = 0) -> torch.Tensor:
    """A window (seq,) int64: `head` tokens of an earlier document, then one [EOT] + body per length."""
    parts = [torch.randint(3, 97, (head,), generator=gen)]
    for n in lengths:
        parts += [torch.tensor([EOT]), torch.randint(3, 97, (n - 1,), generator=gen)]
    return torch.cat(parts)


def test_document_positions_restart_at_each_eot():
    tokens = torch.tensor([[5, 6, EOT, 7, 8, 9, EOT, 4],
                           [EOT, 3, 3, 3, 3, 3, 3, 3]])
    doc, pos = document_positions(tokens, EOT)
    assert doc.tolist() == [[0, 0, 1, 1, 1, 1, 2, 2], [1, 1, 1, 1, 1, 1, 1, 1]]
    assert pos.tolist() == [[0, 1, 0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7]]
    mask = block_causal_mask(doc)[0, 0]
    assert mask[3].tolist() == [False, False, True, True, False, False, False, False]
    assert mask[7].tolist() == [False] * 6 + [True, True]


@pytest.mark.parametrize("n_kv_heads", [2, 4], ids=["gqa", "mha"])
def test_packed_documents_equal_each_document_alone(n_kv_heads):
    args = ModelArgs(**{**ARGS, "n_kv_heads": n_kv_heads, "document_mask": True})
    model = random_model(args)
    gen = torch.Generator().manual_seed(0)
    # Row 0: the tail of an earlier document, then three documents; row 1: three documents.
    layouts = [(7, [20, 9, 28]), (0, [30, 15, 19])]
    windows = torch.stack([packed_window(gen, lengths, head) for head, lengths in layouts])
    with torch.no_grad():
        packed = model(windows)
        for row, (head, lengths) in enumerate(layouts):
            bounds = [0, head] if head else [0]
            for n in lengths:
                bounds.append(bounds[-1] + n)
            for a, b in zip(bounds, bounds[1:]):
                alone = model(windows[row:row + 1, a:b])[0]
                assert (packed[row, a:b] - alone).abs().max().item() <= 1e-5, (row, a, b)
        # Plain causal attention lets the later documents see the earlier ones.
        causal = random_model(ModelArgs(**{**ARGS, "n_kv_heads": n_kv_heads}))(windows)
    assert (packed[1, 30:] - causal[1, 30:]).abs().max().item() > 1e-2


def test_a_window_without_eot_gives_exactly_the_causal_logits():
    masked = random_model(ModelArgs(**{**ARGS, "document_mask": True}))
    plain = random_model(ModelArgs(**ARGS))
    tokens = torch.randint(3, 97, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(masked(tokens), plain(tokens))


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_loss_and_gradients_equal_the_full_logits_loss(chunk):
    model = random_model(ModelArgs(**ARGS)).train()
    tokens = torch.randint(0, 97, (3, 33), generator=torch.Generator().manual_seed(2))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    ref = token_loss_sum(model, inputs, labels)
    ref.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    got = token_loss_sum(model, inputs, labels, chunk_size=chunk)
    got.backward()
    assert abs(got.item() - ref.item()) <= 1e-5 * abs(ref.item())
    for name, p in model.named_parameters():
        err = ((p.grad - want[name]).norm() / want[name].norm()).item()
        assert err <= 1e-5, f"{name}: relative gradient error {err:.2e}"


class _MatmulShapes(TorchDispatchMode):
    """Records the output shape of every matrix multiply run under it."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # aten.matmul reaches the mode undecomposed under inference_mode.
        if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out, torch.ops.aten.addmm.default,
                    torch.ops.aten.addmm_.default, torch.ops.aten.matmul.default, torch.ops.aten.matmul.out):
            self.shapes.append(tuple(out.shape))
        return out


def test_chunked_loss_never_holds_more_than_one_chunk_of_logits_and_recomputes_nothing():
    hidden = torch.randn(40, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    labels = torch.randint(0, 50, (40,))
    with _MatmulShapes() as mode:
        chunked_cross_entropy_sum(hidden, weight, labels, 16).backward()
    logits = [s for s in mode.shapes if s[1] == 50]
    assert logits == [(16, 50), (16, 50), (8, 50)]  # one per chunk, never (40, 50), none recomputed
    assert mode.shapes.count((50, 16)) == 3  # the weight's gradient, accumulated chunk by chunk


@pytest.mark.parametrize("no_autograd", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_chunked_loss_without_autograd_runs_forward_only(no_autograd):
    hidden = torch.randn(40, 16, requires_grad=True)  # as in training: the output weight is a parameter
    weight = torch.randn(50, 16, requires_grad=True)
    labels = torch.randint(0, 50, (40,))
    with no_autograd(), _MatmulShapes() as mode:
        got = chunked_cross_entropy_sum(hidden, weight, labels, 16)
    # One logits matmul per chunk and nothing else: no (50, 16) weight gradient, no (chunk, 16) hidden gradient.
    assert mode.shapes == [(16, 50), (16, 50), (8, 50)]
    assert got.grad_fn is None and got.dtype == torch.float32
    ref = torch.nn.functional.cross_entropy(hidden.detach().double() @ weight.detach().double().t(), labels,
                                            reduction="sum")
    assert abs(got.item() - ref.item()) <= 1e-6 * ref.item()


def test_chunked_validation_loss_equals_the_full_logits_loss():
    model = random_model(ModelArgs(**ARGS)).eval()
    tokens = torch.randint(0, 97, (3, 33), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = token_loss_sum(model, tokens[:, :-1], tokens[:, 1:])
        for chunk in (1, 7, 64, 1000):
            got = token_loss_sum(model, tokens[:, :-1], tokens[:, 1:], chunk_size=chunk)
            assert abs(got.item() - full.item()) <= 1e-6 * full.item(), chunk


def test_a_tokenizer_whose_eot_is_elsewhere_is_refused_with_the_fix(tmp_path):
    from config import check_tokenizer
    from core.errors import SetupError
    from data_pipeline.tokenizer import train_tokenizer

    path = str(tmp_path / "tokenizer.json")
    train_tokenizer(["some text to learn from"] * 5, 300, 10_000).save(path)  # [EOT] is id 2
    check_tokenizer(path, ModelArgs(**{**ARGS, "vocab_size": 300, "document_mask": True}))
    check_tokenizer(path, ModelArgs(**{**ARGS, "vocab_size": 300, "eot_id": 5}), vocab_size=300)  # no mask: fine
    with pytest.raises(SetupError, match=r"\[EOT\] at id 2 but model.eot_id is 5; set --model.eot_id 2"):
        check_tokenizer(path, ModelArgs(**{**ARGS, "vocab_size": 300, "document_mask": True, "eot_id": 5}), 300)
    with pytest.raises(SetupError, match=r"has 2\d\d tokens but model.vocab_size is 97"):
        check_tokenizer(path, ModelArgs(**ARGS))
