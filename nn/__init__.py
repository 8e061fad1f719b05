"""nn: the training objective beside model.py: fp32 cross-entropy on full, chunked or vocabulary-parallel logits, and z-loss (loss.py);
how init, LRs and multipliers scale with width and depth: sp, mup, completep (parametrization.py);
the mixture-of-experts feed-forward: router, top-k dropless routing, grouped experts, balancing (moe.py).

Layer 1, with model.py: imports core/ only. No process groups are created here; the vocabulary-parallel
loss only runs inside torch's `loss_parallel` context that parallel/ and training/ set up.
"""
