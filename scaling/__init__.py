"""scaling: scaling laws fitted to a loss ladder's points: L(N) and L(N, D), their bootstrap interval, the
compute-optimal point and an expanding-window backtest (law.py).

Layer 0: imports nothing of this project; numpy only.
"""
