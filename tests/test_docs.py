"""README.md and docs/*.md against the code: their commands, config keys and links.

A command is a line of a fenced shell block (or an inline `python ...` / `torchrun ...` span; a
span that starts with `...` continues the training command). Each script and config file it
names must exist; each `--section.field` must be a field of config.Config that a command line
can set; every other flag must be one the named script defines (a '--flag' string in its
source; the config scripts also take Config's top-level fields). TOML blocks may use only
Config's sections and fields, and every relative link must reach a file (and its heading).
Everything is read from disk: no script is run.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import os
import re
import shlex
import typing

import pytest
import tomllib

import model
from config import Config, parse_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_MAX_LINES = 220
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
CONFIG_SCRIPTS_MARKERS = ("parse_config(", "command.main(")  # a script whose argv reaches config.parse_config
PRESET_SECTIONS = {"model"}  # config.parse_config's presets: `preset = NAME` in [model]
PLACEHOLDERS = {"section.field", "plan.moe_max_load"}  # the docs' name for any override; plan.py's own flag
REPO_PATH = re.compile(r"^(configs|scripts|benchmarks|tests|docs)/[\w./-]+\.(py|sh|toml|md)$")


def doc_files() -> list[str]:
    """README.md and every docs/*.md page, relative to the root."""
    docs = sorted(f"docs/{f}" for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
    return ["README.md", *docs]


def read(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


# ---- Markdown structure ----------------------------------------------------------------------

FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")


def fenced_blocks(text: str) -> list[tuple[str, int, str]]:
    """(language, line number of the first body line, body) of every fenced code block."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start, body = m.group(2), m.group(3).lower(), i + 2, []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        blocks.append((lang, start, "\n".join(body)))
        i += 1
    return blocks


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line outside fenced code blocks."""
    out, inside, fence = [], False, ""
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m and (not inside or line.strip().startswith(fence)):
            inside, fence = (not inside), m.group(2)
            continue
        if not inside:
            out.append((n, line))
    return out


def inline_spans(text: str) -> list[tuple[int, str]]:
    """(line number, content) of every `inline code` span outside fenced blocks."""
    return [(n, m.group(2)) for n, line in prose_lines(text) for m in re.finditer(r"(`+)(.+?)\1", line)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a Markdown page, with GitHub's -1, -2 suffixes for repeats."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(text):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(1))
            out.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return out


# ---- Config and scripts ----------------------------------------------------------------------

def _table_item(typ):
    """The dataclass D of a list[D] field (a [[section.field]] table), else None."""
    if typing.get_origin(typ) is list:
        (item,) = typing.get_args(typ)
        return item if dataclasses.is_dataclass(item) else None
    return None


@functools.cache
def sections() -> dict[str, type | None]:
    """Config's top-level fields: {name: its dataclass for a section, None for a plain key}."""
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] if dataclasses.is_dataclass(hints[f.name]) else None
            for f in dataclasses.fields(Config)}


def config_flag_problem(name: str) -> str | None:
    """Why `--name` is not a config override (None if it is): '--config', a top-level key, or section.field."""
    if "." not in name:
        if name == "config" or (name in sections() and sections()[name] is None):
            return None
        keys = ", ".join(sorted(k for k, v in sections().items() if v is None))
        return f"--{name} is not a top-level config key (those are --config and {keys})"
    sec, _, field = name.partition(".")
    cls = sections().get(sec)
    if cls is None:
        return f"--{name}: '{sec}' is not a config section ({', '.join(k for k, v in sections().items() if v)})"
    if field == "preset" and sec in PRESET_SECTIONS:
        return None
    hints = typing.get_type_hints(cls)
    if field not in hints:
        return f"--{name}: {cls.__name__} has no field '{field}'"
    if _table_item(hints[field]) is not None:
        return f"--{name}: [[{name}]] tables are set in the --config file only"
    return None


@functools.cache
def script_flags(rel: str) -> frozenset[str]:
    """Every '--flag' a script defines: its string constants that are flags (.py), or the flags it names (.sh)."""
    text = read(rel)
    if rel.endswith(".py"):
        strings = [n.value for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        flags = {s.rstrip("=") for s in strings if re.fullmatch(r"--[\w.-]+=?", s)}
    else:
        flags = set(re.findall(r"--[\w.-]+", text))
    return frozenset(flags | {"--help"})


@functools.cache
def takes_config(rel: str) -> bool:
    """Whether a script hands its other flags to config.parse_config (the trainer's --section.field)."""
    return rel.endswith(".py") and any(m in read(rel) for m in CONFIG_SCRIPTS_MARKERS)


def flag_problems(script: str, args: list[str]) -> list[str]:
    """What is wrong with the flags of `script args...` (script relative to the root)."""
    problems = []
    for arg in args:
        if not arg.startswith("--") or arg == "--":
            continue
        name = arg[2:].split("=", 1)[0]
        if f"--{name}" in script_flags(script):
            continue
        why = config_flag_problem(name)
        if why is None and takes_config(script):
            continue
        problems.append(f"{script}: {why or f'--{name} is not a flag of {script}'}")
    return problems


def path_problems(tokens: list[str]) -> list[str]:
    """Repository paths a command names (configs/..., scripts/..., benchmarks/...) that do not exist."""
    return [f"{t} does not exist" for t in tokens
            if REPO_PATH.match(t) and not os.path.exists(os.path.join(ROOT, t))]


def split_commands(line: str) -> list[list[str]]:
    """The simple commands of one shell line: tokens, split at && || ; |, comments dropped."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    out, cur = [], []
    for tok in lexer:
        if tok and set(tok) <= set(";&|"):
            out.append(cur)
            cur = []
        else:
            cur.append(tok)
    return [c for c in out + [cur] if c]


def check_command(tokens: list[str]) -> list[str]:
    """Problems of one simple command (tokens), or [] when it is not one of this repository's."""
    while tokens and re.match(r"^[A-Za-z_]\w*=", tokens[0]):  # VAR=value prefixes
        tokens = tokens[1:]
    if tokens[:1] == ["env"]:
        return check_command(tokens[1:])
    if not tokens:
        return []
    problems = path_problems(tokens)
    head = tokens[0]
    if head == "...":  # a README journey: the first training command, continued
        return problems + flag_problems("train_fsdp.py", tokens[1:])
    if head in ("python", "python3"):
        if len(tokens) > 1 and tokens[1] == "-m":
            return problems  # a module of another package (pytest, lm_eval)
        rest = tokens[1:]
    elif head in ("torchrun", "sbatch", "srun"):  # the launcher's own options, then the script
        scripts = [i for i, t in enumerate(tokens) if t.endswith((".py", ".sh"))]
        if not scripts:
            return problems  # a launcher's options alone, e.g. `torchrun --max-restarts N`
        rest = tokens[scripts[0]:]
    elif head.endswith((".py", ".sh")):
        rest = tokens
    elif head == "pip" and "install" in tokens:
        return problems + extras_problems(tokens)
    else:
        return problems  # another tool (ruff, export, wandb, aws, ...)
    if not rest:
        return problems
    script, args = rest[0], rest[1:]
    if not os.path.isfile(os.path.join(ROOT, script)):
        return problems + [f"{script} does not exist"]
    if script.endswith("slurm_train.sh"):
        args = [a for a in args if a != "--dry-run"]
        positional = args[:3]  # SCRIPT CONFIG RUN_DIR, then the trainer's flags
        problems += [f"{p} does not exist" for p in positional[:2] if not os.path.isfile(os.path.join(ROOT, p))]
        if len(positional) == 3 and os.path.isfile(os.path.join(ROOT, positional[0])):
            problems += flag_problems(positional[0], args[3:])
        return problems
    return problems + flag_problems(script, args)


@functools.cache
def extras() -> frozenset[str]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return frozenset(tomllib.load(f)["project"]["optional-dependencies"])


def extras_problems(tokens: list[str]) -> list[str]:
    """Extras that `pip install -e ".[a,b]"` names and pyproject.toml does not define."""
    named = [e.strip() for t in tokens for m in re.finditer(r"\.\[([\w,\s-]+)\]", t) for e in m.group(1).split(",")]
    return [f"pip install: no extra '{e}' in pyproject.toml" for e in named if e not in extras()]


def shell_commands(block: str) -> list[tuple[int, str]]:
    """(line offset, command line) of a shell block: continuation lines joined, '$ ' prompts dropped."""
    out, pending, start = [], "", 0
    for i, line in enumerate(block.splitlines()):
        if not pending:
            start = i
        line = re.sub(r"^\s*\$ ", "", line) if not pending else line
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((start, pending + line))
        pending = ""
    if pending:
        out.append((start, pending))
    return out


def command_problems(text: str) -> list[str]:
    """Problems of every command of a Markdown text: fenced shell blocks and inline command spans."""
    problems = []
    for lang, first, body in fenced_blocks(text):
        if lang not in SHELL_LANGS:
            continue
        for offset, line in shell_commands(body):
            try:
                commands = split_commands(line)
            except ValueError as e:  # unbalanced quotes: not a shell line (an error message, a diagram)
                if re.match(r"^\s*(python|torchrun|sbatch)\b", line):
                    problems.append(f"line {first + offset}: cannot parse: {e}")
                continue
            problems += [f"line {first + offset}: {p}" for c in commands for p in check_command(c)]
    for n, span in inline_spans(text):
        if re.match(r"^(python3?|torchrun|sbatch|\.\.\.) ", span):
            try:
                commands = split_commands(span)
            except ValueError:
                continue
            problems += [f"line {n}: {p}" for c in commands for p in check_command(c)]
    return problems


def inline_flag_problems(text: str) -> list[str]:
    """Every `--section.field` named in prose (inline code) must be a settable config field."""
    problems = []
    for n, span in inline_spans(text):
        for m in re.finditer(r"(?<![\w-])--([a-z_]+\.[a-z_0-9]+)\b(?![.*])", span):
            if m.group(1) in PLACEHOLDERS:
                continue
            why = config_flag_problem(m.group(1))
            if why:
                problems.append(f"line {n}: {why}")
    return problems


def toml_problems(text: str) -> list[str]:
    """Sections and keys of every ```toml block that Config does not have."""
    problems = []
    for lang, first, body in fenced_blocks(text):
        if lang != "toml":
            continue
        try:
            data = tomllib.loads(body)
        except tomllib.TOMLDecodeError as e:
            problems.append(f"line {first}: not valid TOML: {e}")
            continue
        for sec, values in data.items():
            cls = sections().get(sec, "missing")
            if cls == "missing":
                problems.append(f"line {first}: [{sec}] is not a config section or key")
                continue
            if cls is None or not isinstance(values, dict):
                continue
            hints = typing.get_type_hints(cls)
            for key, value in values.items():
                if key == "preset" and sec in PRESET_SECTIONS:
                    continue
                if key not in hints:
                    problems.append(f"line {first}: {sec}.{key} is not a field of {cls.__name__}")
                    continue
                item = _table_item(hints[key])
                for table in (value if item is not None and isinstance(value, list) else []):
                    known = typing.get_type_hints(item)
                    problems += [f"line {first}: [[{sec}.{key}]] {k} is not a field of {item.__name__}"
                                 for k in table if k not in known]
    return problems


def link_problems(rel: str, text: str) -> list[str]:
    """Relative links [..](path#anchor) and images of a page that reach no file or heading."""
    problems = []
    base = os.path.dirname(os.path.join(ROOT, rel))
    for n, line in prose_lines(text):
        for m in re.finditer(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", line):
            target = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            full = os.path.normpath(os.path.join(base, path)) if path else os.path.join(ROOT, rel)
            if not os.path.exists(full):
                problems.append(f"line {n}: {target}: no such file")
            elif anchor and full.endswith(".md"):
                with open(full, encoding="utf-8") as f:
                    if anchor not in anchors(f.read()):
                        problems.append(f"line {n}: {target}: no heading '#{anchor}' in {os.path.relpath(full, ROOT)}")
    return problems


def named_file_problems(text: str) -> list[str]:
    """`dir/name.py` or `name.py` (`.sh`) spans that name no file: a module moved away or renamed.

    A bare name is a file at the root, or in a folder a `folder/` span of the same line names
    (the code map's rows: `core/` ... `cli.py`).
    """
    problems = []
    for n, line in prose_lines(text):
        spans = [m.group(2) for m in re.finditer(r"(`+)(.+?)\1", line)]
        folders = [""] + [s for s in spans if re.fullmatch(r"[\w./-]+/", s)]
        for span in spans:
            if span != "__init__.py" and re.fullmatch(r"[\w./-]+\.(py|sh)", span) and not any(
                    os.path.isfile(os.path.join(ROOT, folder, span)) for folder in (folders if "/" not in span else [""])):
                problems.append(f"line {n}: `{span}` is not a file of the repository (give its path from the root)")
    return problems


# ---- Tests -----------------------------------------------------------------------------------

def _all(check) -> list[str]:
    return [f"{rel}:{p}" for rel in doc_files() for p in check(read(rel))]


def test_readme_is_a_landing_page():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        n = sum(1 for _ in f)
    assert n <= README_MAX_LINES, f"README.md has {n} lines; move detail into docs/ (limit {README_MAX_LINES})"


def test_readme_keeps_the_ci_commands():
    """.ci/run runs the README's set-up and test commands: they stay word for word in both."""
    readme, ci = read("README.md"), read(".ci/run")
    for command, in_ci in (('pip install torch==2.13.0 -e ".[dev]"', 'torch==2.13.0 -e ".[dev]"'),
                           ("python -m pytest tests", "python -m pytest tests")):
        assert command in readme, f"README.md lost `{command}`, which .ci/run runs"
        assert in_ci in ci, f".ci/run no longer runs `{command}`: keep README.md in step"


def test_readme_gives_the_cpu_install_command_with_the_ci_pin():
    """A laptop's first command must not fetch the CUDA build: the README names the CPU wheel index, same pin as CI."""
    pin = re.search(r"torch==([\w.]+)", read(".ci/run")).group(1)
    for rel in ("README.md", "docs/quickstart.md"):
        assert f"pip install torch=={pin} --index-url https://download.pytorch.org/whl/cpu" in read(rel), rel


def _installed_closure(name: str, extra: str) -> set[str]:
    """The distributions that `pip install NAME[EXTRA]` brings, read from this environment's metadata."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen, todo = set(), [(name, {extra})]
    while todo:
        dist, extras = todo.pop()
        key = (canonicalize_name(dist), frozenset(extras))
        if key in seen:
            continue
        seen.add(key)
        for line in metadata.distribution(dist).requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras | {""}):
                todo.append((req.name, set(req.extras)))
    return {n for n, _ in seen}


def test_readme_counts_the_packages_of_the_dev_extra():
    stated = int(re.search(r"\| `dev` \|[^|]*?(\d+) packages", read("README.md")).group(1))
    actual = len(_installed_closure("llama-pretrain", "dev"))
    assert abs(stated - actual) <= 0.1 * actual, f"README.md says the dev extra brings {stated} packages; it is {actual}"


@pytest.mark.parametrize("journey", ["mixture of experts", "pipeline parallelism"])
def test_readme_journeys_train_a_model_of_the_debug_models_active_size(journey):
    """Rows that show a way to train compare with the debug model: the same active parameters (an MoE's router aside)."""
    row = next(line for line in read("README.md").splitlines() if line.startswith(f"| {journey}"))
    tokens = shlex.split(row.split("`")[1])
    overrides = [t for i, t in enumerate(tokens) if t.startswith("--model.") or tokens[i - 1].startswith("--model.")]
    debug = ["--config", os.path.join(ROOT, "configs", "debug.toml")]
    shown = model.num_params(parse_config(debug + overrides, "", require_file=True).model, active=True)
    dense = model.num_params(parse_config(debug, "", require_file=True).model, active=True)
    assert abs(shown - dense) <= 0.01 * dense, f"the README's {journey} row trains {shown:,} active parameters: " \
                                               f"the debug model has {dense:,} ({overrides})"


def test_commands_name_existing_scripts_and_flags():
    problems = _all(command_problems)
    assert not problems, "stale commands in the docs:\n" + "\n".join(problems)


def test_inline_config_flags_exist():
    problems = _all(inline_flag_problems)
    assert not problems, "config flags in the docs' text that Config lacks:\n" + "\n".join(problems)


def test_toml_blocks_use_config_fields():
    problems = _all(toml_problems)
    assert not problems, "TOML examples with keys Config lacks:\n" + "\n".join(problems)


def test_relative_links_resolve():
    problems = [f"{rel}:{p}" for rel in doc_files() for p in link_problems(rel, read(rel))]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_named_files_exist():
    problems = _all(named_file_problems)
    assert not problems, "files named in the docs that do not exist:\n" + "\n".join(problems)


def test_cluster_md_prints_the_composition_table():
    """docs/cluster.md's table of the settings that do not run together is parallel/composition.py's, row for row."""
    from parallel.composition import markdown

    section = read("docs/cluster.md").split("\n## What composes with what\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    assert rows == markdown().splitlines(), ("docs/cluster.md's composition table differs from composition.TABLE; "
                                             "paste the output of python -c 'from parallel.composition import "
                                             "markdown; print(markdown())'")


def test_the_checks_catch_stale_docs():
    """Each check reports a planted mistake (and passes the corrected snippet)."""
    bad = ("```bash\ntorchrun --standalone --nproc_per_node=2 train_fsdp.py --config configs/debug.toml \\\n"
           "    --run_dir runs/x --train.stepz 10 --optim.name muon\n```\n")
    problems = command_problems(bad)
    assert len(problems) == 1 and "no field 'stepz'" in problems[0] and problems[0].startswith("line 2:"), problems
    assert command_problems(bad.replace("stepz", "steps")) == []
    # a table field, a missing section, a script's own flag, a config flag where none is taken
    assert command_problems("```\npython train_fsdp.py --data.sources x\n```") != []
    assert command_problems("```\npython train_fsdp.py --trian.steps 1\n```") != []
    assert command_problems("```\npython generate.py --run_dir r --promt x\n```") != []
    assert command_problems("```\npython generate.py --run_dir r --prompt x --train.steps 3\n```") != []
    assert command_problems("```\npython evaluate.py --run_dir r --max_sequences 64 --data.dataset f\n```") == []
    assert command_problems("```\npython benchmarks/bench.py --threads 2 --model.dim 64\n```") == []
    # paths: a moved script, a missing config, slurm's positional script and its flags, extras
    assert command_problems("```\ntorchrun --nproc_per_node=2 trainer.py --run_dir r\n```") != []
    assert command_problems("```\npython prepare.py --config configs/nope.toml\n```") != []
    assert command_problems("```\nsbatch --nodes=2 scripts/slurm_train.sh train_fsdp.py configs/debug.toml /r "
                            "--parallel.dp_replicat 2\n```") != []
    assert command_problems('```\npip install -e ".[hf,wandbb]"\n```') == ["line 2: pip install: no extra 'wandbb' "
                                                                          "in pyproject.toml"]
    # inline spans, TOML keys, links and anchors, file names
    assert command_problems("the row: `... --optim.nam muon`\n") != []
    assert inline_flag_problems("set `--train.z_los 1e-4`\n") != []
    assert inline_flag_problems("set `--train.z_loss 1e-4` and `--data.*`\n") == []
    assert toml_problems("```toml\n[train]\nstepz = 3\n[[data.sources]]\nname = 'a'\nwieght = 1\n```") != []
    assert toml_problems("```toml\n[train]\nsteps = 3\n[[data.sources]]\nname = 'a'\nweight = 1\n```") == []
    assert link_problems("README.md", "[x](docs/nope.md)\n") != []
    assert link_problems("README.md", "[x](docs/data.md#no-such-heading)\n") != []
    assert link_problems("README.md", "[x](docs/data.md#mixtures-datasources-and-datastages)\n") == []
    assert named_file_problems("the loop in `trainer.py`, the step in `training/step.py`\n") == [
        "line 1: `trainer.py` is not a file of the repository (give its path from the root)"]
