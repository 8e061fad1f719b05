"""Documents of random characters: the stretch of bad data in configs/debug_rollback.toml.

    python scripts/random_text.py --out runs/random_text.jsonl

Writes 40 JSON lines {"text": ...} of 2,000 characters each, drawn uniformly (seed 0) from
U+0021..U+23FF without the C1 controls: mostly characters the debug corpus (Python sources)
never holds, so a model trained on it meets a loss far above its recent steps there, the
divergence that train.rollback undoes (docs/rollback.md#a-run-that-diverges).
"""
from __future__ import annotations

import argparse
import json
import os
import random


def random_documents(n: int = 40, chars: int = 2000, seed: int = 0) -> list[str]:
    """n strings of `chars` characters from U+0021..U+23FF without U+007F..U+00A0, the same for the same seed."""
    rng = random.Random(seed)
    pool = [chr(c) for c in range(0x21, 0x2400) if not 0x7F <= c <= 0xA0 and not 0xD800 <= c <= 0xDFFF]
    return ["".join(rng.choice(pool) for _ in range(chars)) for _ in range(n)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/random_text.jsonl", help="the .jsonl file to write (its folder is created)")
    a = p.parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in random_documents())
    print(f"wrote {a.out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
