"""The writing side of the data: tokenize a source and pack it into a run's data directory.

    python prepare.py --config FILE.toml --run_dir DIR [--data.field value ...]
    torchrun --standalone --nproc_per_node=N prepare.py --config FILE.toml --run_dir DIR   (N processes)
    python prepare.py tokenizer --config FILE.toml --out runs/tokenizer.json [--data.field value ...]

The first writes what a training run would write into DIR/data (tokenizer.json, tokens.bin,
meta.json), so a long tokenization need not happen inside the process group's timeout; the
training run then finds it and reads it as it is. ``tokenizer`` trains a tokenizer alone.
(``python data.py prepare`` of earlier versions is ``python prepare.py`` now.)

Pipeline: documents (sources.py) -> byte-level BPE ids (tokenizer.py) -> one ``[EOT]``
after every document -> one flat uint32 token stream (data.py reads it). Every rank
tokenizes its share of fixed work units and rank 0 joins them in unit order, so the stream
is byte-identical at any world size.
"""
from __future__ import annotations

import itertools
import json
import os
import shutil
import sys
import time
from typing import BinaryIO, Iterable, Iterator

import numpy as np
import torch.distributed as dist

import distributed
from config import check_run_dir, parse_config
from data import DataConfig, DataError, read_meta
from errors import ConfigError, UserError, report
from progress import duration
from sources import check_source, iter_documents, source_units
from tokenizer import EOT, load_tokenizer, train_tokenizer


def pack_documents(docs: Iterable[list[int]], eot_id: int) -> np.ndarray:
    """Concatenate token-id lists into one stream with eot_id after every document.

    Returns a 1-D uint32 array of sum(len(d) + 1) tokens: nothing is padded or cut.
    """
    parts = []
    for ids in docs:
        parts.append(np.asarray(ids, dtype=np.uint32))
        parts.append(np.asarray([eot_id], dtype=np.uint32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)


DOCS_PER_UNIT = 256
"""Documents per work unit when max_documents bounds the source (the first N documents in order)."""


def _rank_units(cfg: DataConfig, rank: int, world: int) -> tuple[int, Iterator[tuple[int, Iterator[str]]]]:
    """(number of units of the source, an iterator of (unit index, documents) over those rank tokenizes).

    Unit u goes to rank u % world. With max_documents the units are blocks of DOCS_PER_UNIT
    documents of the first N (their number an upper bound: the source may hold fewer); every
    rank reads those N (a bounded read) and keeps its blocks. Otherwise the units are the
    source's own (source_units) and a rank reads only its own.
    """
    if not cfg.max_documents:
        units = source_units(cfg)
        return len(units), ((u, units[u]()) for u in range(rank, len(units), world))
    return -(-cfg.max_documents // DOCS_PER_UNIT), _document_blocks(cfg, rank, world)


def _document_blocks(cfg: DataConfig, rank: int, world: int) -> Iterator[tuple[int, Iterator[str]]]:
    for u, block in itertools.groupby(enumerate(iter_documents(cfg)), key=lambda item: item[0] // DOCS_PER_UNIT):
        if u % world == rank:
            yield u, (text for _, text in block)
        else:
            for _ in block:  # groupby needs the block consumed before it moves on
                pass


class _ProgressLines:
    """Rank 0's progress while tokenizing: one line at most every INTERVAL_S seconds, and one at the end.

    Rank 0 sees only its own share; the ranks share the units evenly, so its ETA is the run's.
    """

    INTERVAL_S = 10.0

    def __init__(self, enabled: bool, n_units: int, rank: int, world: int):
        self.enabled, self.world = enabled, world
        self.mine = len(range(rank, n_units, world))
        self.units = self.docs = self.tokens = 0
        self.t0 = self.last = time.perf_counter()
        if enabled:
            print(f"[data] tokenizing {n_units} work unit(s) on {world} rank(s)", flush=True)

    def unit_done(self, n_tokens: int, n_docs: int) -> None:
        self.units, self.docs, self.tokens = self.units + 1, self.docs + n_docs, self.tokens + n_tokens
        now = time.perf_counter()
        if self.enabled and (now - self.last >= self.INTERVAL_S or self.units == self.mine):
            self.last, elapsed = now, now - self.t0
            eta = elapsed / self.units * max(0, self.mine - self.units)
            print(f"[data] rank 0: {self.units}/{self.mine} units, {self.docs:,} documents, {self.tokens:,} tokens, "
                  f"{self.tokens / max(elapsed, 1e-9):,.0f} tokens/s, {'ETA ' + duration(eta) if eta else 'done'}",
                  flush=True)


def tokenize_documents(texts: Iterable[str], tokenizer, out: BinaryIO, batch: int = 256) -> tuple[int, int]:
    """Tokenize and pack documents (blank ones skipped), appending the uint32 stream to out.

    Writes batch by batch, so memory stays bounded however large the unit. Returns
    (n_tokens written, n_documents).
    """
    eot = tokenizer.token_to_id(EOT)
    n_tokens, n_docs, pending = 0, 0, []

    def flush():
        nonlocal n_tokens, n_docs
        encs = tokenizer.encode_batch(pending, add_special_tokens=False)
        stream = pack_documents((e.ids for e in encs), eot)
        out.write(stream.tobytes())
        n_tokens += int(stream.size)
        n_docs += len(pending)
        pending.clear()

    for text in texts:
        if text.strip():
            pending.append(text)
            if len(pending) >= batch:
                flush()
    if pending:
        flush()
    return n_tokens, n_docs


def share_cores_between_local_ranks() -> None:
    """Give this process's tokenizer threads its share of the node's cores (call before tokenizing).

    HF tokenizers' thread pool takes every core by default; with torchrun's LOCAL_WORLD_SIZE
    processes per node that oversubscribes the node that many times. An explicit
    RAYON_NUM_THREADS is left alone.
    """
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if local > 1:
        os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // local)))


def _gather_single(obj):
    return [obj]


def prepare(cfg: DataConfig, out_dir: str, rank: int = 0, world: int = 1, all_gather=_gather_single) -> dict:
    """Tokenize the corpus once into out_dir: tokenizer.json, tokens.bin (uint32 stream), meta.json.

    Collective when world > 1: every rank calls it, and all_gather(obj) must return the list
    of every rank's obj (e.g. torch.distributed.all_gather_object on a gloo group). Rank 0
    trains or loads the tokenizer; then rank r tokenizes the work units u with u % world == r
    (see _rank_units) into parts/ of out_dir + '.tmp' (a directory every rank can reach), and
    rank 0 joins them in unit order. The stream is therefore the same at every world size.

    Reuses what an earlier call left there, so a resumed run reads the same tokens. Writes
    into out_dir + '.tmp' and renames it at the end: bad input or a crash leaves no out_dir.
    Returns the meta dict on every rank. Raises DataError, on every rank, for bad input found
    on any rank, or if out_dir was prepared with other data settings.
    """
    tmp = out_dir + ".tmp"
    parts = os.path.join(tmp, "parts")

    def agree(fn):
        """fn() on this rank; the results of all ranks, or the first rank's DataError on every rank."""
        try:
            result, error = fn(), None
        except DataError as e:
            result, error = None, str(e)
        gathered = all_gather((result, error))
        errors = [e for _, e in gathered if e is not None]
        if errors:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise DataError(errors[0])
        return [r for r, _ in gathered]

    done = agree(lambda: _start_prepare(cfg, out_dir, tmp) if rank == 0 else None)[0]
    if done is not None:
        return done
    tokenizer = None

    def tokenize_mine():
        nonlocal tokenizer
        if not os.path.isfile(os.path.join(tmp, "tokenizer.json")):
            raise DataError(f"rank {rank} cannot see '{tmp}', which rank 0 wrote: the run directory must be on "
                            f"a filesystem that every node shares")
        tokenizer = load_tokenizer(os.path.join(tmp, "tokenizer.json"))
        n_units, units = _rank_units(cfg, rank, world)
        progress = _ProgressLines(rank == 0, n_units, rank, world)
        counts = []
        for u, texts in units:
            with open(os.path.join(parts, f"{u:07d}.bin"), "wb") as out:
                counts.append((u, *tokenize_documents(texts, tokenizer, out)))
            progress.unit_done(*counts[-1][1:])
        return counts

    counts = sorted(c for rank_counts in agree(tokenize_mine) for c in rank_counts)
    return agree(lambda: _finish_prepare(cfg, out_dir, tmp, tokenizer, counts) if rank == 0 else None)[0]


# Fields that decide the token stream; seq_len, val_fraction and the shuffle apply when it is read.
_PREPARED_FROM = ("dataset", "dataset_config", "split", "text_column", "max_documents", "decode_errors",
                  "tokenizer", "tokenizer_vocab_size", "tokenizer_train_chars")


def _prepared_from(cfg: DataConfig) -> dict:
    """The data settings a prepared directory records and a later run must repeat."""
    return {k: getattr(cfg, k) for k in _PREPARED_FROM}


def _start_prepare(cfg: DataConfig, out_dir: str, tmp: str) -> dict | None:
    """Rank 0: the meta of an earlier, matching preparation; or None after writing tmp/tokenizer.json."""
    meta_path = os.path.join(out_dir, "meta.json")
    if os.path.exists(meta_path):
        meta = read_meta(out_dir)
        wanted = _prepared_from(cfg)
        changed = [f"data.{k}: {meta['config'].get(k)!r} -> {v!r}" for k, v in wanted.items()
                   if meta.get("config", {}).get(k) != v]
        if changed:
            raise DataError(
                f"'{out_dir}' was prepared with other data settings ({'; '.join(changed)}); "
                f"use a new --run_dir, or the settings the run started with"
            )
        return meta
    shutil.rmtree(tmp, ignore_errors=True)
    if os.path.lexists(out_dir) and not (os.path.isdir(out_dir) and not os.listdir(out_dir)):  # ours has meta.json (tmp is renamed whole): this is someone's files
        raise DataError(f"'{out_dir}' exists but was not prepared by this tool (no meta.json); move it away, "
                        f"or use another --run_dir")
    shutil.rmtree(out_dir, ignore_errors=True)  # an empty folder
    os.makedirs(os.path.join(tmp, "parts"))
    if cfg.tokenizer:
        tokenizer = load_tokenizer(cfg.tokenizer)
    else:
        print(f"[data] training a byte-level BPE tokenizer of {cfg.tokenizer_vocab_size} tokens on up to "
              f"{cfg.tokenizer_train_chars:,} characters of '{cfg.dataset}'", flush=True)
        tokenizer = train_tokenizer(iter_documents(cfg), cfg.tokenizer_vocab_size, cfg.tokenizer_train_chars)
    tokenizer.save(os.path.join(tmp, "tokenizer.json"))
    return None


def _finish_prepare(cfg: DataConfig, out_dir: str, tmp: str, tokenizer, counts: list[tuple[int, int, int]]) -> dict:
    """Rank 0: join the parts in unit order into tokens.bin, write meta.json, rename tmp to out_dir."""
    if [u for u, _, _ in counts] != list(range(len(counts))):
        raise DataError(f"data.dataset: '{cfg.dataset}' changed while it was read (work units {counts[:5]}...)")
    n_docs = sum(n for _, _, n in counts)
    if n_docs == 0:
        raise DataError(f"data.dataset: '{cfg.dataset}' holds no non-empty document; point it at real text")
    with open(os.path.join(tmp, "tokens.bin"), "wb") as out:
        for u, _, _ in counts:
            part = os.path.join(tmp, "parts", f"{u:07d}.bin")
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 24)
            os.remove(part)
    os.rmdir(os.path.join(tmp, "parts"))
    meta = {"tokenizer": os.path.join(out_dir, "tokenizer.json"), "vocab_size": tokenizer.get_vocab_size(),
            "n_tokens": sum(n for _, n, _ in counts), "n_documents": n_docs, "work_units": len(counts),
            "config": _prepared_from(cfg)}
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(tmp, out_dir)
    return meta


def prepare_on_all_ranks(cfg: DataConfig, out_dir: str) -> dict:
    """prepare() on every rank of the current process group (collective), on a LONG_TIMEOUT gloo group.

    Returns the meta dict on every rank; raises DataError on every rank (see prepare).
    """
    share_cores_between_local_ranks()
    group = distributed.long_timeout_group()
    try:
        return prepare(cfg, out_dir, dist.get_rank(), dist.get_world_size(), distributed.gatherer(group))
    finally:
        dist.destroy_process_group(group)


def main(argv: list[str] | None = None) -> int:
    """Command line (see the module docstring); exit status 2 with one line on bad input."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    command = "prepare"
    if argv and argv[0] in ("prepare", "tokenizer"):  # `prepare` is the default; `python data.py prepare` had it
        command, argv = argv[0], argv[1:]
    try:
        out = None
        if command == "tokenizer":
            argv = [piece for a in argv for piece in (a.split("=", 1) if a.startswith("--out=") else [a])]
            if "--out" not in argv or argv.index("--out") + 1 >= len(argv):
                raise ConfigError("tokenizer needs --out PATH")
            i = argv.index("--out")
            out = argv[i + 1]
            del argv[i:i + 2]
            if os.path.lexists(out):
                raise ConfigError(f"--out '{out}' exists; choose a path that does not (nothing is overwritten)")
        cfg = parse_config(argv, __doc__, require_file=True)
        check_source(cfg.data)
        if command == "tokenizer":
            tok = train_tokenizer(iter_documents(cfg.data), cfg.data.tokenizer_vocab_size,
                                  cfg.data.tokenizer_train_chars)
            os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
            tok.save(out)
            print(f"wrote {out}: {tok.get_vocab_size()} tokens")
            return 0
        check_run_dir(cfg.run_dir)
        out_dir = os.path.join(cfg.run_dir, "data")
        if distributed.world_size() == 1:
            meta = prepare(cfg.data, out_dir)
        else:  # no collective but the gathers of prepare(), whose tokenization may take hours
            share_cores_between_local_ranks()
            dist.init_process_group("gloo", timeout=distributed.LONG_TIMEOUT)
            try:
                meta = prepare(cfg.data, out_dir, dist.get_rank(), dist.get_world_size(), distributed.gatherer())
                distributed.finish_distributed()
            finally:
                distributed.abandon_distributed()
        if int(os.environ.get("RANK", 0)) == 0:
            print(json.dumps({k: v for k, v in meta.items() if k != "config"}))
    except UserError as e:
        report(e)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
