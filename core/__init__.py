"""core: what every other layer uses: one-line user errors (errors.py) and the TOML + `--section.field` config machinery (cli.py).

Layer 0: imports nothing of this project.
"""
