"""training: the run: build a session, the loop and its one step, and the components that own their cadence.

Layer 10: imports everything below it, including the root commands prepare.py and hf.py (their
library halves) and config.py; nothing below imports it.
"""
