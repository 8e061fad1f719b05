"""storage: where a run's files live: local paths or URLs (s3://, through fsspec) behind one interface (fs.py), and the names of the files in a run directory (rundir.py).

Layer 2: imports core/ only.
"""
