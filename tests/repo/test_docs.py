"""The docs stay true to the code: the generated config reference is current, relative
links (and their #anchors) resolve, every `enn-submit <command>` the docs show exists with
the flags they use, and every module and site key is documented. Fast: no torch, no
subprocess except one import check.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from enn_cluster.config import docs as config_docs
from enn_cluster.cluster import site
from enn_cluster.client.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

# Subcommands the docs may show before they are registered in enn_cluster/cli.py. Once a
# command is registered it is checked like any other (flags included), whether or not it
# is still listed here; empty this set when they have all landed.
PENDING_COMMANDS: set[str] = set()

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_MENTION = re.compile(r"(?:^|(?<=[\s/(]))enn-submit\s+([a-z][a-z0-9_-]*)")
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
_CUT = re.compile(r"\||&&|;|\)|\s#|enn-submit")


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def _fences(text: str) -> tuple[list[str], list[str]]:
    """(lines outside fenced blocks, lines of fenced blocks with continuations joined)."""
    outside, code, block, fenced = [], [], [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            if fenced:
                code.extend("\n".join(block).replace("\\\n", " ").splitlines())
                block = []
            fenced = not fenced
            continue
        (block if fenced else outside).append(line)
    return outside, code


def split_markdown(text: str) -> tuple[list[str], list[str]]:
    """(prose lines without code, code snippets): fenced blocks and inline code spans."""
    outside, code = _fences(text)
    code += [m.group(1) for line in outside for m in _INLINE_CODE.finditer(line)]
    return [_INLINE_CODE.sub("", line) for line in outside], code


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors: lower case, punctuation dropped, spaces -> '-', '-N' for repeats."""
    prose, _ = _fences(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    anchors = set()
    for line in prose:
        m = _HEADING.match(line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(2).replace("`", "").lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def command_mentions(code_lines: list[str]) -> list[tuple[str, list[str]]]:
    """(command, flags used with it) for every `enn-submit <command> ...` in code."""
    out = []
    for line in code_lines:
        for m in _MENTION.finditer(line):
            rest = line[m.end():]
            cut = _CUT.search(rest)
            rest = rest[:cut.start()] if cut else rest
            out.append((m.group(1), _FLAG.findall(rest)))
    return out


# ---------------------------------------------------------------------------------------


def test_config_reference_is_current():
    expected = config_docs.render_config_reference()
    path = DOCS / "config.md"
    actual = path.read_text(encoding="utf-8") if path.exists() else ""
    assert actual == expected, (f"{path.relative_to(ROOT)} is stale: run "
                                f"`{config_docs.WRITE_COMMAND}` and commit the result")


def test_config_fields_and_descriptions_must_match():
    missing = {k: v for k, v in config_docs.DESCRIPTIONS.items() if k != "training.lr"}
    with pytest.raises(ValueError, match=r"training\.lr"):
        config_docs.render_config_reference(missing)
    extra = {**config_docs.DESCRIPTIONS, "training.no_such_field": "gone"}
    with pytest.raises(ValueError, match=r"training\.no_such_field"):
        config_docs.render_config_reference(extra)


def test_config_docs_does_not_import_torch():
    code = ("import sys, enn_cluster.config.docs as d; d.render_config_reference(); "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.call([sys.executable, "-c", code], cwd=ROOT) == 0


def test_relative_links_resolve():
    broken = []
    for md in markdown_files():
        prose, _ = split_markdown(md.read_text(encoding="utf-8"))
        for line in prose:
            for target in _LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                path_part, _, anchor = target.partition("#")
                dest = (md.parent / path_part).resolve() if path_part else md
                where = f"{md.relative_to(ROOT)}: ({target})"
                if not dest.exists():
                    broken.append(f"{where} points to a missing file")
                elif anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest):
                    broken.append(f"{where}: no heading with anchor #{anchor}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_documented_commands_exist_with_their_flags():
    commands = subcommands()
    problems, seen = [], set()
    for md in markdown_files():
        _, code = split_markdown(md.read_text(encoding="utf-8"))
        for command, flags in command_mentions(code):
            seen.add(command)
            where = md.relative_to(ROOT)
            if command not in commands:
                if command not in PENDING_COMMANDS:
                    problems.append(f"{where}: `enn-submit {command}` is not a subcommand "
                                    f"(there are: {', '.join(sorted(commands))})")
                continue
            known = commands[command]._option_string_actions
            problems += [f"{where}: `enn-submit {command}` has no flag {flag}"
                         for flag in flags if flag not in known]
    assert not problems, "\n".join(problems)
    assert {"train", "resume", "status", "verify", "build", "render"} <= seen


def test_command_mentions_are_parsed():
    code = ['IMG=$(enn-submit build --cache-dir /x) && sbatch --nodes=2 f',
            '.venv/bin/enn-submit status RUN  # --not-a-flag',
            'enn-submit COMMAND --help', 'the enn-submit --help output']
    assert command_mentions(code) == [("build", ["--cache-dir"]), ("status", [])]


def test_architecture_names_every_module():
    text = (DOCS / "architecture.md").read_text(encoding="utf-8")
    pkg = ROOT / "enn_cluster"
    names = [p.relative_to(pkg).as_posix() for p in sorted(pkg.rglob("*.py"))
             if p.name != "__init__.py" or p.parent == pkg]
    missing = [n for n in names if f"`{n}`" not in text]
    assert not missing, f"docs/architecture.md has no paragraph for: {', '.join(missing)}"


def test_admin_guide_names_every_site_key():
    text = (DOCS / "admin.md").read_text(encoding="utf-8")
    missing = [k for k in site.KEYS if f"`{k}`" not in text]
    assert not missing, f"docs/admin.md does not document site keys: {', '.join(missing)}"


_WRITES = re.compile(r"--(?:out|input)\s+(\S+)|np\.save\('([^']+)'")


def test_local_quickstart_commands_keep_their_files_under_demo_runs():
    """The commands a new user pastes in the clone (`.venv/bin/...`) write their inputs,
    predictions and plots under the ignored demo-runs/, never into the repository root."""
    _, code = split_markdown((DOCS / "quickstart.md").read_text(encoding="utf-8"))
    local = [line for line in code if ".venv/bin/" in line]
    paths = [a or b for line in local for a, b in _WRITES.findall(line)]
    assert len(paths) >= 4, paths  # the predict/collect/plot block is still there
    outside = [p for p in paths if not p.startswith(("demo-runs/", "/", "$"))]
    assert not outside, f"docs/quickstart.md writes into the checkout: {outside}"


# -- run-directory paths and ENN_* variables in the admin's docs (issue 40) -----------------
OPS_DOCS = ("admin.md", "troubleshooting.md")
_RUN_PATH = re.compile(r"RUN_DIR/[^\s`'\"|),;]+")
_SCRIPT_PATH = re.compile(r"(?:\$ENN_RUN_DIR|\$\{ENN_RUN_DIR\}|/shared/runs/[a-z0-9]+)/[^\s'\")]+")
_ENN_NAME = re.compile(r"\bENN_[A-Z0-9_]+\b")
_PLACEHOLDER = re.compile(r"<[^>]*>|\$\{[^}]*\}|\$[A-Za-z_]+|%[a-z]|\.\.\.|\b[A-Z][A-Z0-9_]*\b")


def canonical(path: str) -> str:
    """A run-directory path with every stand-in (`<job id>`, JOB, N, `%j`, `$SLURM_JOB_ID`,
    ...) as `*`: a doc's spelling and the code's compare equal when they name the same file."""
    path = re.sub(r"[.:]+$", "", path.split("RUN_DIR/", 1)[-1]).rstrip("/")
    return re.sub(r"\*+", "*", _PLACEHOLDER.sub("*", path))


def rendered_scripts() -> list[str]:
    """What reaches sbatch: the admin templates, every golden spec rendered by `render
    --admin` and by the submitit path (`render`)."""
    from enn_cluster.cluster import job_script
    from render_support import TEMPLATES, golden_specs, make_submitit_script

    specs = golden_specs().values()
    return [*(p.read_text(encoding="utf-8") for p in sorted(TEMPLATES.glob("*.sbatch"))),
            *(job_script.render_batch_script(s) for s in specs),
            *(make_submitit_script(s, f"{s.run_dir}/slurm/%j") for s in specs)]


def produced_paths() -> set[str]:
    """Every run-directory path storage/layout.py declares or a batch script writes."""
    from enn_cluster.storage import layout

    declared = {canonical(e.name) for e in layout.LAYOUT}
    written = {canonical(re.sub(r"^[^/]*/?(?:shared/runs/[a-z0-9]+/)?", "", m))
               for text in rendered_scripts() for m in _SCRIPT_PATH.findall(text)}
    return declared | written


def doc_paths(name: str) -> list[str]:
    spans = _INLINE_CODE.findall((DOCS / name).read_text(encoding="utf-8"))
    return [m for span in spans for m in _RUN_PATH.findall(re.sub(r"<[^>]*>", "<x>", span))]


def unproduced_paths(paths: list[str], produced: set[str]) -> list[str]:
    """Doc paths the code does not produce. A path right under the run directory, or right
    under a folder the batch shell writes in (logs/, requeue/, slurm/), must be one that
    layout.py declares or a script writes; any other must lie in a declared folder and
    name a file the package writes (its name's fixed part is in the package's source)."""
    from enn_cluster.storage import layout

    strict = {layout.LOGS, layout.REQUEUE, layout.SUBMITIT}
    source = "\n".join(p.read_text(encoding="utf-8")
                       for p in (ROOT / "enn_cluster").rglob("*") if p.suffix in (".py", ".sh"))
    tops = {p.split("/")[0] for p in produced}  # predictions/<name>/ declares predictions
    bad = []
    for path in paths:
        parts = canonical(path).split("/")
        stem = parts[-1].split("*")[0]
        ok = ("/".join(parts) in produced
              or len(parts) == 2 and parts[0] in tops and parts[-1] == "*"
              or (len(parts) > 2 or parts[0] not in strict) and parts[0] in tops
              and len(parts) > 1 and bool(stem) and stem in source)
        if not ok:
            bad.append(path)
    return bad


def test_paths_in_the_admin_docs_are_what_the_code_writes():
    produced = produced_paths()
    assert "logs/slurm-*.out" in produced  # the batch log: layout.py and every script
    for name in OPS_DOCS:
        paths = doc_paths(name)
        assert len(paths) >= 5, (name, paths)
        bad = unproduced_paths(paths, produced)
        assert not bad, f"docs/{name} names run-directory paths the code does not write: {bad}"


def test_a_path_the_code_never_writes_is_caught():
    """The old spellings of the batch log, and files nobody writes, fail the check above."""
    produced = produced_paths()
    old = ["RUN_DIR/logs/%x-%j.out", "RUN_DIR/logs/<job name>-<job id>.out",
           "RUN_DIR/slurm/<job id>/<job id>_0_log.out", "RUN_DIR/requeue/halt-JOB",
           "RUN_DIR/logs/ATTEMPT/no-such-rank-R.json", "RUN_DIR/nowhere.json"]
    assert unproduced_paths(old, produced) == old


def enn_names_the_code_reads() -> set[str]:
    """ENN_* names in the package's source and the templates (read or set there), plus the
    ones the test suite and Makefile read (ENN_UPDATE_GOLDEN)."""
    files = [*(ROOT / "enn_cluster").rglob("*.py"), *(ROOT / "enn_cluster").rglob("*.sh"),
             *(ROOT / "enn_cluster").rglob("*.sbatch"), ROOT / "Makefile",
             *(ROOT / "tests").rglob("test_*.py")]
    docs = {DOCS / n for n in OPS_DOCS}
    return {n for f in files if f not in docs for n in _ENN_NAME.findall(f.read_text("utf-8"))}


def test_enn_variables_in_the_admin_docs_exist_and_the_template_table_is_complete():
    """Every ENN_* name admin.md and troubleshooting.md use is one the code reads or sets,
    and admin.md's table of the templates' variables lists exactly the ENN_* names the
    templates take from the environment."""
    known = enn_names_the_code_reads()
    for name in OPS_DOCS:
        unknown = sorted(set(_ENN_NAME.findall((DOCS / name).read_text("utf-8"))) - known)
        assert not unknown, f"docs/{name} names variables no code reads: {unknown}"
    from render_support import TEMPLATES

    read = {n for p in TEMPLATES.glob("*.sbatch")
            for n in re.findall(r"\$\{(ENN_[A-Z0-9_]+)[:+}-]", p.read_text("utf-8"))}
    text = (DOCS / "admin.md").read_text("utf-8")
    table = set(re.findall(r"^\| `(ENN_[A-Z0-9_]+)` \|", text, re.M))
    assert read - table == set(), f"admin.md's variable table lacks {sorted(read - table)}"
    assert table - read == set(), f"admin.md's variable table lists {sorted(table - read)}, " \
        "which the templates do not read"
    assert "ENN_MIN_NODES" in table


def test_the_quickstart_chat_example_is_a_valid_row_and_config():
    """docs/quickstart.md's chat row is one our checks accept (every message a known role
    with text, an assistant turn to learn) and its data section is a valid config; the
    row is staged and its mask checked in tests/storage/test_chat_staging.py."""
    import json

    import yaml

    from enn_cluster.config.loading import config_from_dict
    from enn_cluster.storage.chat_tokens import check_conversation

    text = (DOCS / "quickstart.md").read_text(encoding="utf-8")
    (row,) = re.findall(r"```json\n(\{\"messages\".*?)\n```", text, re.S)
    (section,) = re.findall(r"```yaml\n(data:\n  messages_field.*?)```", text, re.S)
    data = yaml.safe_load(section)["data"]
    field = data["messages_field"]
    messages = check_conversation(json.loads(row)[field], field, "the quickstart's row")
    assert [m["role"] for m in messages] == ["system", "user", "assistant"]
    cfg = config_from_dict({"model": {"name": "hf:/weights"}, "data": data})
    assert cfg.data.messages_field == field and cfg.data.packing is True
