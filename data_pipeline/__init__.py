"""data_pipeline: from raw text to the global batch of each step, behind data.py's PackedCorpus.

sources.py and filesplit.py (where documents come from, in fixed work units), tokenizer.py,
pretokenized.py and streams.py (corpora tokenized elsewhere, read in place as one flat stream; ranged.py
when they are in a bucket),
token_rows.py (a parquet/arrow column of token ids, copied once),
mixture.py (how many samples of each source a batch takes), loader.py (the global sample cursor),
datacache.py (prepared data shared through a bucket).

Layer 5, with data.py: imports core/, storage/ and data.py.
"""
