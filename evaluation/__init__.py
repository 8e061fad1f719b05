"""evaluation: scores of a model: held-out validation loss (validation.py) and multiple-choice downstream tasks scored as lm-evaluation-harness does (downstream.py).

Layer 7, with checkpoint.py: imports core/, nn/, parallel/, data.py and data_pipeline/.
"""
