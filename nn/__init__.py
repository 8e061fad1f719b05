"""nn: the training objective beside model.py: fp32 cross-entropy on full, chunked or vocabulary-parallel logits, and z-loss (loss.py);
how init, LRs and multipliers scale with width and depth: sp, mup, completep (parametrization.py);
the mixture-of-experts feed-forward: router, top-k dropless routing, grouped experts, balancing (moe.py),
its fields of model.ModelArgs with their checks (moe_args.py), and the experts' grouped matmul, a kernel where
torch runs one and the loop as reference (grouped_mm.py), and the row gathers that sort its tokens by expert and back
(rows.py); what each parameter is for, declared by
its module and read by init, mup, Muon, float8 and export (roles.py); packed windows' documents, positions
and attention masks (documents.py).

Layer 1, with model.py: imports core/ only. No process groups are created here; the vocabulary-parallel
loss only runs inside torch's `loss_parallel` context that parallel/ and training/ set up.
"""
