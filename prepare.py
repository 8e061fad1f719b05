"""The writing side of the data: tokenize the sources and pack each into a run's data directory.

    python prepare.py --config FILE.toml --run_dir DIR [--data.field value ...] [--data.prepared s3://BUCKET/PREFIX]
    torchrun --standalone --nproc_per_node=N prepare.py --config FILE.toml --run_dir DIR   (N processes)
    python prepare.py tokenizer --config FILE.toml --out runs/tokenizer.json [--data.field value ...]

The first writes what a training run would write into DIR/data (tokenizer.json, one token
file per source under sources/, meta.json), so a long tokenization need not happen inside the process group's timeout; the
training run then finds it and reads it as it is. With data.prepared set, DIR/data is then
also uploaded there (meta.json last) for runs whose nodes share no filesystem (datacache.py). ``tokenizer`` trains a tokenizer alone.
(``python data.py prepare`` of earlier versions is ``python prepare.py`` now.)

Pipeline, per source: documents (sources.py) -> byte-level BPE ids of the plain text
(tokenizer.encode_plain) -> one ``[EOT]`` after every document -> one flat token stream,
uint16 when the vocabulary fits in 65,536 ids, else uint32 (data.py reads it). Every rank
tokenizes its share of fixed work units and rank 0 joins them in unit order, so the stream
is byte-identical at any world size.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import sys
from typing import BinaryIO, Iterable, Iterator

import numpy as np
import torch.distributed as dist

from config import check_run_dir, parse_config
from core.cli import exit_command
from core.errors import ConfigError, UserError, report
from data import DEFAULT_SOURCE, DataConfig, DataError, SourceConfig, read_meta, token_dtype
from data_pipeline import index_cache, megatron_index, pretokenized, token_rows
from data_pipeline.datacache import publish
from data_pipeline.mixture import weight_shares
from data_pipeline.sources import check_source, files_record, iter_documents, source_changed, source_units, txt_notice
from data_pipeline.tokenizer import encode_plain, load_tokenizer, separator_ids, train_tokenizer, write_tokenizer_config
from observability.progress import ProgressLines
from parallel import distributed
from storage import fs
from storage.fs import check_location
from storage.rundir import RunDir, check_local_dir


def pack_documents(docs: Iterable[list[int]], eot_id: int, dtype: str = "uint32", bos_id: int | None = None
                   ) -> np.ndarray:
    """Concatenate token-id lists into one stream with eot_id (the EOS) after every document, bos_id before each.

    Returns a 1-D array of dtype ('uint16' or 'uint32') of sum(len(d) + 1 (+ 1 with a BOS))
    tokens: nothing is padded or cut. Raises DataError if an id does not fit dtype.
    """
    head = [] if bos_id is None else [bos_id]
    parts = [np.asarray([*head, *ids, eot_id], dtype=np.int64) for ids in docs]
    stream = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    if stream.size and stream.max() > np.iinfo(dtype).max:
        raise DataError(f"data.tokenizer: token id {stream.max()} does not fit {dtype}; the tokenizer has more ids "
                        f"than its vocabulary size says")
    return stream.astype(dtype)


DOCS_PER_UNIT = 256
"""Documents per work unit when max_documents bounds the source (the first N documents in order)."""


def _rank_units(cfg: SourceConfig, rank: int, world: int) -> tuple[int, Iterator[tuple[int, Iterator[str]]]]:
    """(number of units of the source, an iterator of (unit index, documents) over those rank tokenizes).

    Unit u goes to rank u % world. With max_documents the units are blocks of DOCS_PER_UNIT
    documents of the first N (their number an upper bound: the source may hold fewer); every
    rank reads those N (a bounded read) and keeps its blocks. Otherwise the units are the
    source's own (source_units) and a rank reads only its own.
    """
    if cfg.format == "tokens":  # token ids already: one unit per file, copied by token_rows.copy_rows
        return token_rows.rank_units(cfg, rank, world)
    if not cfg.max_documents:
        units = source_units(cfg)
        return len(units), ((u, units[u]()) for u in range(rank, len(units), world))
    return -(-cfg.max_documents // DOCS_PER_UNIT), _document_blocks(cfg, rank, world)


def _document_blocks(cfg: SourceConfig, rank: int, world: int) -> Iterator[tuple[int, Iterator[str]]]:
    for u, block in itertools.groupby(enumerate(iter_documents(cfg)), key=lambda item: item[0] // DOCS_PER_UNIT):
        if u % world == rank:
            yield u, (text for _, text in block)
        else:
            for _ in block:  # groupby needs the block consumed before it moves on
                pass


def tokenize_documents(texts: Iterable[str], tokenizer, out: BinaryIO, dtype: str = "uint32",
                       batch: int = 256, separators: tuple[int, int | None] | None = None) -> tuple[int, int]:
    """Tokenize (as plain text) and pack documents (blank ones skipped), appending the dtype stream to out.

    separators: (EOS id, BOS id or None), tokenizer.separator_ids (default: [EOT], no BOS). Writes batch
    by batch, so memory stays bounded however large the unit. Returns (n_tokens written, n_documents).
    """
    eot, bos = separators or (tokenizer.token_to_id("[EOT]"), None)
    n_tokens, n_docs, pending = 0, 0, []

    def flush():
        nonlocal n_tokens, n_docs
        stream = pack_documents(encode_plain(tokenizer, pending), eot, dtype, bos)
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
    """Tokenize every source of cfg once into out_dir: tokenizer.json, sources/<name>-<key>.bin, meta.json.

    Collective when world > 1: every rank calls it, and all_gather(obj) must return the list
    of every rank's obj (e.g. torch.distributed.all_gather_object on a gloo group). Rank 0
    trains (on the sources in proportion to their weights) or loads the tokenizer; then, for
    each source not prepared yet, rank r tokenizes the work units u with u % world == r (see
    _rank_units) into a parts folder every rank can reach, and rank 0 joins them in unit
    order into the source's token file (uint16 when the vocabulary fits, else uint32). The
    files are therefore the same at every world size.

    A source is keyed by its reading settings and the tokenizer: one prepared earlier (under
    any name) is reused, so changing weights or stages, or adding a source, tokenizes only
    the new one. A first preparation is written into out_dir + '.tmp' and renamed at the
    end, so bad input or a crash leaves no out_dir; a later one writes meta.json last. A
    directory prepared before mixtures (one uint32 tokens.bin) is read as its one source.
    Returns the meta dict (data.read_meta's layout plus "n_tokens" and "n_documents" of
    cfg's sources) on every rank. Raises DataError, on every rank, for bad input found on
    any rank, or if out_dir holds the tokenizer or a source of that name prepared otherwise.
    """
    tmp = out_dir + ".tmp"
    plan: dict = {}

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
                shutil.rmtree(tmp if plan.get("work") in (None, tmp) else os.path.join(out_dir, PARTS),
                              ignore_errors=True)
            raise DataError(errors[0])
        return [r for r, _ in gathered]

    plan.update(agree(lambda: _start_prepare(cfg, out_dir, tmp) if rank == 0 else None)[0])
    work, meta, by_name = plan["work"], plan["meta"], {s.name: s for s in cfg.source_list()}
    tokenizer = None

    def tokenize_mine(src, parts):
        nonlocal tokenizer
        if not os.path.isfile(os.path.join(work, "tokenizer.json")):
            raise DataError(f"rank {rank} cannot see '{work}', which rank 0 wrote: the run directory must be on "
                            f"a filesystem that every node shares")
        tokenizer = tokenizer or load_tokenizer(os.path.join(work, "tokenizer.json"))
        separators = separator_ids(os.path.join(work, "tokenizer.json"), cfg.eos_token, cfg.bos_token, tokenizer)
        n_units, units = _rank_units(src, rank, world)
        progress = ProgressLines(rank == 0, n_units, rank, world, src.name)
        counts = []
        for u, texts in units:
            with open(os.path.join(parts, f"{u:07d}.bin"), "wb") as out:
                counts.append((u, *(token_rows.copy_rows(texts, src.token_column, out, separators[0], meta["dtype"],
                                                           tokenizer.get_vocab_size()) if src.format == "tokens" else
                                    tokenize_documents(texts, tokenizer, out, meta["dtype"], separators=separators))))
            progress.unit_done(*counts[-1][1:])
        return counts

    for name, file in plan["todo"]:
        src, parts = by_name[name], os.path.join(work, PARTS, name)
        counts = sorted(c for rank_counts in agree(lambda: tokenize_mine(src, parts)) for c in rank_counts)
        record = agree(lambda: _join_source(src, work, parts, file, counts, meta["dtype"]) if rank == 0 else None)[0]
        meta["sources"][name] = {**record, "files": plan["files"][name]} if plan["files"].get(name) else record
        if rank == 0 and src.max_documents and record["n_documents"] < src.max_documents:
            _say_cap(src, "tokenized", record["n_documents"])
    agree(lambda: _finish_prepare(out_dir, tmp, work, meta, plan["changed"], cfg) if rank == 0 else None)
    meta = {**meta, "tokenizer": os.path.join(out_dir, "tokenizer.json")}
    records = [meta["sources"][name] for name in by_name]
    return {**meta, "n_tokens": sum(r["n_tokens"] for r in records),
            "n_documents": sum(max(0, r["n_documents"]) for r in records)}  # -1: numpy files do not count them


PARTS = ".parts"
"""Folder of the ranks' tokenized work units while a source is prepared (inside the data directory or its .tmp)."""


def _changed(old: dict, new: dict, field) -> list[str]:
    return [f"{field(k)}: {old.get(k)!r} -> {v!r}" for k, v in new.items() if old.get(k) != v]


def _other_settings(out_dir: str, changed: list[str], also: str = "") -> DataError:
    return DataError(f"'{out_dir}' was prepared with other data settings ({'; '.join(changed)}); use a new "
                     f"--run_dir, {also}or the settings the run started with")


def _start_prepare(cfg: DataConfig, out_dir: str, tmp: str) -> dict:
    """Rank 0: the plan {"work": folder to write in, "meta", "todo": [(source name, file)], "changed"}.

    Checks an earlier preparation against cfg, or starts a new one in tmp with the tokenizer.
    """
    check_source(cfg)  # a path that matches nothing, or blank text, before a tokenizer is trained on it
    meta_path = os.path.join(out_dir, "meta.json")
    wanted_tok = cfg.prepared_settings()["tokenizer"]
    if os.path.exists(meta_path):
        meta, work = read_meta(out_dir), out_dir
        changed = _changed(meta["tokenizer_config"], wanted_tok, lambda k: f"data.{k}")
        if changed:
            raise _other_settings(out_dir, changed)
        shutil.rmtree(os.path.join(out_dir, PARTS), ignore_errors=True)
    else:
        shutil.rmtree(tmp, ignore_errors=True)
        if os.path.lexists(out_dir) and not (os.path.isdir(out_dir) and not os.listdir(out_dir)):  # ours has meta.json (tmp is renamed whole): this is someone's files
            raise DataError(f"'{out_dir}' exists but was not prepared by this tool (no meta.json); move it away, "
                            f"or use another --run_dir")
        shutil.rmtree(out_dir, ignore_errors=True)  # an empty folder
        work = tmp
        os.makedirs(tmp)
        tokenizer = _make_tokenizer(cfg)
        tokenizer.save(os.path.join(tmp, "tokenizer.json"))
        write_tokenizer_config(cfg, tmp)
        meta = {"tokenizer": os.path.join(out_dir, "tokenizer.json"), "vocab_size": tokenizer.get_vocab_size(),
                "tokenizer_config": wanted_tok, "sources": {}}
    meta.setdefault("dtype", token_dtype(meta["vocab_size"]))  # of the files written from now on
    with open(os.path.join(work, "tokenizer.json"), "rb") as f:
        tokenizer_hash = hashlib.sha1(f.read()).hexdigest()
    todo, changed, files = [], work == tmp, {}
    for src in cfg.source_list():
        record = meta["sources"].get(src.name)
        if record is not None and record["config"] != src.reading():
            raise _other_settings(out_dir, _changed(record["config"], src.reading(), src.field),
                                  "" if src.name == DEFAULT_SOURCE else "another source name, ")
        if src.pretokenized and src.format != "tokens":  # read in place: recorded, never copied
            changed = pretokenized.record_in_place(src, meta, out_dir) or changed
            continue
        files[src.name] = token_rows.files_record(src) if src.pretokenized else files_record(src)
        if record is not None and record.get("files") and files[src.name] and \
                record["files"]["digest"] != files[src.name]["digest"]:
            raise source_changed(src, out_dir, record["files"], files[src.name])
        same = [r for r in meta["sources"].values() if r["config"] == src.reading()]
        if record is None and same:  # prepared under another name: the same tokens
            meta["sources"][src.name], changed = same[0], True
        elif record is None:
            key = hashlib.sha1(json.dumps({"source": src.reading(), "tokenizer": tokenizer_hash},
                                          sort_keys=True).encode()).hexdigest()[:12]
            todo.append((src.name, os.path.join("sources", f"{src.name}-{key}.bin")))
            os.makedirs(os.path.join(work, PARTS, src.name))
            changed = True
        _say_cap(src, "tokenizing" if record is None and not same else "prepared",
                 (record or (same[0] if same else {})).get("n_documents"))
        notice = txt_notice(src) if record is None and not same else ""
        if notice:
            print(f"[data] notice: {notice}", flush=True)
    return {"work": work, "meta": meta, "todo": todo, "changed": changed, "files": files}


def _say_cap(src, verb: str, n_documents: int | None = None) -> None:
    """The source's line: what is done with it, and what data.max_documents keeps of it (n_documents: its count, when
    known, so that a source smaller than the cap is not said to be cut)."""
    field = "data.max_documents" if src.name == DEFAULT_SOURCE else \
        f"{src.field('max_documents')}, or data.max_documents when the table leaves it out"
    cap = ""
    if src.max_documents and n_documents is not None and n_documents < src.max_documents:
        cap = f": all its {n_documents:,} documents (fewer than {field.split(',')[0]} {src.max_documents:,})"
    elif src.max_documents and n_documents is not None:
        cap = f": its first {src.max_documents:,} documents only ({field}; 0 reads all)"
    elif src.max_documents:
        cap = f": at most its first {src.max_documents:,} documents ({field}; 0 reads all)"
    print(f"[data] source '{src.name}' ({src.dataset}) {verb}{cap}", flush=True)


def _make_tokenizer(cfg: DataConfig):
    """Rank 0: the tokenizer of data.tokenizer, or one trained on the sources in proportion to their weights."""
    if cfg.tokenizer:
        return load_tokenizer(cfg.tokenizer)
    if not (srcs := [s for s in cfg.source_list() if not s.pretokenized]):
        raise DataError("data.tokenizer is empty but every source holds token ids; give its tokenizer.json")
    shares = ", ".join(f"{s.name} {share:.0%}" for s, share in zip(srcs, weight_shares([s.weight for s in srcs])))
    print(f"[data] training a byte-level BPE tokenizer of {cfg.tokenizer_vocab_size} tokens on up to "
          f"{cfg.tokenizer_train_chars:,} characters of {shares}", flush=True)
    return train_tokenizer(tokenizer_texts(cfg), cfg.tokenizer_vocab_size, cfg.tokenizer_train_chars)


def tokenizer_texts(cfg: DataConfig) -> Iterator[str]:
    """Documents to train a tokenizer on: each source's first ones, up to tokenizer_train_chars x its weight share.

    A source gets documents while it has had fewer characters than its budget, so it may
    exceed it by one document; a source of weight 0 gets none.
    """
    srcs = [s for s in cfg.source_list() if not s.pretokenized]  # token ids teach a tokenizer nothing
    for src, share in zip(srcs, weight_shares([s.weight for s in srcs])):
        budget, seen = cfg.tokenizer_train_chars * share, 0
        for text in iter_documents(src) if budget > 0 else ():
            if seen >= budget:
                break
            seen += len(text)
            yield text


def _join_source(src, work: str, parts: str, file: str, counts: list[tuple[int, int, int]], dtype: str) -> dict:
    """Rank 0: join the parts in unit order into work/file; returns the source's meta record."""
    if [u for u, _, _ in counts] != list(range(len(counts))):
        raise DataError(f"{src.field('dataset')}: '{src.dataset}' changed while it was read (work units "
                        f"{counts[:5]}...)")
    n_docs = sum(n for _, _, n in counts)
    if n_docs == 0:
        raise DataError(f"{src.field('dataset')}: '{src.dataset}' holds no non-empty document; point it at real text"
                        + ("" if src.name == DEFAULT_SOURCE else " or remove the source"))
    path = os.path.join(work, file)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    digest = hashlib.sha256()  # checked by the nodes that copy the file from data.prepared (datacache.py)
    with open(path + ".tmp", "wb") as out:
        for u, _, _ in counts:
            part = os.path.join(parts, f"{u:07d}.bin")
            with open(part, "rb") as f:
                while block := f.read(1 << 24):
                    digest.update(block)
                    out.write(block)
            os.remove(part)
    os.replace(path + ".tmp", path)
    os.rmdir(parts)
    return {"file": file, "dtype": dtype, "n_tokens": sum(n for _, n, _ in counts), "n_documents": n_docs,
            "work_units": len(counts), "config": src.reading(), "sha256": digest.hexdigest()}


def _finish_prepare(out_dir: str, tmp: str, work: str, meta: dict, changed: bool, cfg: DataConfig) -> None:
    """Rank 0: write meta.json (when anything changed), each stream's Megatron .idx with data.prepared_format
    megatron, and, for a first preparation, rename tmp to out_dir."""
    shutil.rmtree(os.path.join(work, PARTS), ignore_errors=True)
    if cfg.prepared_format == "megatron":
        eos, _ = separator_ids(os.path.join(work, "tokenizer.json"), cfg.eos_token, cfg.bos_token)
        megatron_index.index_streams(work, meta, eos)
    in_place = [meta["sources"][s.name] for s in cfg.source_list() if "shards" in meta["sources"].get(s.name, {})]
    index_cache.save(work, [p for r in in_place for p in pretokenized.index_paths(r)])  # renamed with tmp, or alone
    if changed:
        record = {k: v for k, v in meta.items() if k != "legacy"}
        record["tokenizer_sha256"] = fs.sha256(os.path.join(work, "tokenizer.json"))
        with open(os.path.join(work, "meta.json.tmp"), "w") as f:
            json.dump(record, f, indent=1)
        os.replace(os.path.join(work, "meta.json.tmp"), os.path.join(work, "meta.json"))
    if work == tmp:
        os.replace(tmp, out_dir)


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
            check_local_dir(os.path.dirname(out) or ".", "--out's folder")  # before minutes of training
        cfg = parse_config(argv, __doc__, require_file=True)
        check_source(cfg.data)
        if command == "tokenizer":
            tok = train_tokenizer(tokenizer_texts(cfg.data), cfg.data.tokenizer_vocab_size,
                                  cfg.data.tokenizer_train_chars)
            os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
            tok.save(out)
            print(f"wrote {out}: {tok.get_vocab_size()} tokens")
            return 0
        check_run_dir(cfg.run_dir)
        check_location(cfg.data.prepared, "--data.prepared")
        if cfg.data.prepared and not fs.is_url(cfg.data.prepared):  # where it publishes: before the tokenizing
            check_local_dir(cfg.data.prepared, "--data.prepared")
        out_dir = RunDir(cfg.run_dir).data
        if distributed.world_size() == 1:
            meta = prepare(cfg.data, out_dir)
        else:  # no collective but the gathers of prepare(), whose tokenization may take hours
            share_cores_between_local_ranks()
            distributed.die_with_agent()
            dist.init_process_group("gloo", timeout=distributed.LONG_TIMEOUT)
            try:
                meta = prepare(cfg.data, out_dir, dist.get_rank(), dist.get_world_size(), distributed.gatherer())
                distributed.finish_distributed()
            finally:
                distributed.abandon_distributed()
        if int(os.environ.get("RANK", 0)) == 0:
            print(json.dumps({"tokenizer": meta["tokenizer"], "vocab_size": meta["vocab_size"],
                              "n_tokens": meta["n_tokens"], "n_documents": meta["n_documents"],
                              "sources": {n: {k: v for k, v in r.items() if k != "config"}
                                          for n, r in meta["sources"].items()}}))
            if cfg.data.prepared:
                publish(out_dir, cfg.data.prepared)
    except UserError as e:
        report(e)
        return 2
    return 0


if __name__ == "__main__":
    exit_command(main())
