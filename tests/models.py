"""Small models for tests that compare against a reference implementation."""
import torch

from model import ModelArgs, Transformer


def random_model(args: ModelArgs, seed: int = 0) -> Transformer:
    """Weights far from init (norm weights not 1, larger matrices), so a wrong weight mapping or a
    wrong KV cache shows in the logits, and the next token is rarely a near tie."""
    model = Transformer(args)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.3 * noise if name.endswith("norm.weight") else 0.15 * noise)
    return model.eval()
