"""optimization: how gradients become updates: AdamW and Muon with their LR schedules (optimizers.py, muon.py) and the spike guard's rule (spike.py).

Layer 6: imports core/ and nn/parametrization.py (each parameter's LR multiplier) only, and torch.
"""
