"""The product's face: README.md is short, starts with the two fresh-machine commands, holds no research-process
residue (timestamps, commit hashes, load averages, "issue N", paper file numbers), and every relative link in it
resolves to a file of the repository; the CLI's --help holds no such residue either; docs/site_configuration.md
lists every site-config key with the default the code uses. Text checks only (fast, no data)."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"

FRESH_MACHINE = [
    "```bash",
    "make demo   # fresh machine: creates .venv, installs, runs OHFL on 6 width-sites of ../shared/data (real images)",
    "make test   # fresh machine: creates .venv, installs, runs the test suite (the command CI runs)",
    "```",
]

RESIDUE = {
    "a timestamp": re.compile(r"\b20\d\d-\d\d-\d\d\b|\b\d{1,2}:\d\d(:\d\d)?\s*(UTC|GMT)\b", re.I),
    "a commit hash": re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"),
    "a load average": re.compile(r"\bload(\s+average)?\s*(of\s*)?~?\d", re.I),
    '"issue N"': re.compile(r"\bissues?[\s#-]*\d+", re.I),
    "a paper file number": re.compile(r"(?<![\d.,])00[0-3](?![\d.,])|\bpaper\s+00\d"),
}


def residue(text: str) -> list[str]:
    """The residue patterns found in ``text``, each as "<kind>: <match>"."""
    return [f"{kind}: {m.group(0)!r}" for kind, pat in RESIDUE.items() for m in pat.finditer(text)]


def test_residue_patterns_catch_the_known_cases_and_spare_ordinary_text():
    bad = ("Last quiet run (2026-11-30 17:31 UTC, the code before issue 15's second pass (d2fb3f2), load average 2-6)"
           " as in paper 003")
    kinds = {r.split(":")[0] for r in residue(bad)}
    assert kinds == {"a timestamp", "a commit hash", "a load average", '"issue N"', "a paper file number"}
    ok = ("nvflare 2.9.0, pot 0.9.7.post1, lr 0.001, 1,003 images, doi:10.17632/rscbjbr9sj.2, 1,715 images, "
          "seeds 0 / 1 / 2, AUC 0.951, "
          "Issues and pull requests are welcome; the load is shared; deadbeef is a word")
    assert residue(ok) == []


def test_readme_is_short_and_starts_with_the_two_fresh_machine_commands():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines (at most 150)"
    assert lines[0].startswith("# ")
    assert lines[2:6] == FRESH_MACHINE, "README.md must open with the two fresh-machine commands, unchanged"
    make = (REPO / "Makefile").read_text()
    assert re.search(r"^demo:.*\n\t.*cxr-hfl simulate --method ohfl --sites 6 --scheme width", make, re.M)
    assert re.search(r"^test:.*\n\t.*-m pytest", make, re.M)


def test_readme_holds_no_research_process_residue():
    found = residue(README.read_text(encoding="utf-8"))
    assert not found, "README.md: " + "; ".join(found)


def test_readme_has_the_disclaimer_licence_and_one_results_table():
    text = README.read_text(encoding="utf-8")
    assert "not for clinical use" in text.lower()[:1500], "the not-for-clinical-use disclaimer belongs near the top"
    assert (REPO / "LICENSE").read_text().lstrip().startswith("Apache License")
    deps = re.findall(r'"([A-Za-z0-9_.-]+)==', (REPO / "pyproject.toml").read_text().split("[project.optional")[0])
    assert "## Licence" in text and "docs/LICENSES.md" in text.split("## Licence", 1)[1]
    table = (REPO / "docs" / "LICENSES.md").read_text(encoding="utf-8")  # the licence table moved to docs/
    missing = [d for d in deps if f"| {d} |" not in table]
    assert deps and not missing, f"docs/LICENSES.md: licence table lacks {missing}"
    assert len(re.findall(r"^## Results", text, re.M)) == 1


def _links(text: str) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("doc", ["README.md", "benchmarks/README.md", "studies/README.md"])
def test_every_relative_link_resolves_to_a_file_in_the_repository(doc):
    path = REPO / doc
    links = [u for u in _links(path.read_text(encoding="utf-8")) if not re.match(r"[a-z]+:", u) and
             not u.startswith("#")]
    assert links or doc != "README.md"
    broken = []
    for u in links:
        target = (path.parent / u.split("#", 1)[0]).resolve()
        if not target.is_relative_to(REPO) or not target.is_file():
            broken.append(u)
    assert not broken, f"{doc}: links that do not resolve to a file of the repository: {broken}"


def _all_help() -> str:
    from nvflare_jobs.cli import build_parser

    out, todo = [], [build_parser()]
    while todo:
        p = todo.pop()
        out.append(p.format_help())
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                todo.extend(a.choices.values())
    return "\n".join(out)


def test_cli_help_holds_no_research_process_residue():
    text = _all_help()
    assert "simulate" in text and "--method" in text
    found = [r for r in residue(text) if not r.startswith("a paper file number")]
    assert not found, "--help: " + "; ".join(found)
    assert not re.search(r"\bAUC\s+0\.\d", text), "--help quotes measured AUCs"


def test_site_configuration_doc_lists_every_key_with_the_codes_default():
    from hfl_components.flare.site_config import DEFAULTS, TOP_KEYS

    doc = (REPO / "docs" / "site_configuration.md").read_text(encoding="utf-8")
    block = re.search(r"```yaml\n(.*?)```", doc, re.S)
    assert block, "docs/site_configuration.md needs one ```yaml block of every key"
    listed = yaml.safe_load(block.group(1))
    assert set(listed) == TOP_KEYS, \
        f"missing {sorted(TOP_KEYS - set(listed))}, unknown {sorted(set(listed) - TOP_KEYS)}"
    wrong = {k: (listed[k], v) for k, v in DEFAULTS.items() if listed[k] != v}
    assert not wrong, f"doc default != DEFAULTS for {wrong}"


def test_site_configuration_doc_names_every_dp_key_with_its_default():
    from hfl_components.privacy.dp import DPSpec

    doc = (REPO / "docs" / "site_configuration.md").read_text(encoding="utf-8")
    block = re.search(r"```yaml\n(.*?)```", doc, re.S).group(1)
    dp_entry = block[block.index("\ndp:"):]
    dp_entry = dp_entry[:re.search(r"\n[a-z_]+:", dp_entry[1:]).end()]  # up to the next top-level key
    for name, f in DPSpec.__dataclass_fields__.items():
        assert re.search(rf"\b{name}\b", dp_entry), f"dp.{name} is accepted but not documented"
        if isinstance(f.default, (int, float, str)) and not isinstance(f.default, bool):
            assert re.search(rf"\b{name} \([^)]*\b{re.escape(str(f.default))}\b", dp_entry), \
                f"dp.{name}: its default {f.default!r} is not documented"


def test_benchmarks_readme_lists_every_script_and_studies_follow_the_template():
    listed = (REPO / "benchmarks" / "README.md").read_text(encoding="utf-8")
    scripts = sorted(p.name for p in (REPO / "benchmarks").glob("*.py") if p.name != "__init__.py")
    unlisted = [s for s in scripts if f"`{s}`" not in listed]
    assert scripts and not unlisted, f"benchmarks/README.md must list every script: {unlisted}"
    topics = [p for p in (REPO / "studies").iterdir() if p.is_dir() and not p.name.startswith(("_", "."))]
    assert topics
    for t in topics:
        md = sorted(p.name for p in t.glob("*.md"))
        assert md == ["RESULTS.md"], f"{t.name}: one RESULTS.md per topic, found {md}"
        heads = re.findall(r"^## (.+)$", (t / "RESULTS.md").read_text(encoding="utf-8"), re.M)
        assert heads == ["Question", "Protocol", "Command and commit", "Results", "Decision"], f"{t.name}: {heads}"


def test_no_sys_path_hacks_and_no_machine_paths_in_benchmarks_and_studies():
    hacks = [str(p.relative_to(REPO)) for d in ("benchmarks", "studies") for p in (REPO / d).rglob("*.py")
             if "sys.path.insert" in p.read_text(encoding="utf-8")]
    assert not hacks, f"use packages and python -m instead of sys.path.insert: {hacks}"
    machine = re.compile(r"(?<![\w.])/(work|home|tmp|Users|root|mnt|scratch)/|[A-Z]:\\\\")
    found = [f"{p.relative_to(REPO)}: {m.group(0)}"
             for d in ("benchmarks", "studies") for p in (REPO / d).rglob("*")
             if p.is_file() and p.suffix in {".md", ".json", ".jsonl", ".csv", ".html"}
             for m in [machine.search(p.read_text(encoding="utf-8", errors="replace"))] if m]
    assert not found, f"results with absolute machine paths: {found}"


def test_every_cxr_hfl_command_in_the_readme_parses_with_the_cli():
    """Each `cxr-hfl ...` line of README.md's code blocks is accepted by the CLI's own parser (options and choices
    exist), so the quickstart and the everyday commands stay true when an option is renamed."""
    import shlex

    from nvflare_jobs.cli import build_parser

    cmds = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(encoding="utf-8"), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if "cxr-hfl " in line:
                cmds.append(line.split("cxr-hfl ", 1)[1])
    assert len(cmds) >= 10
    parser = build_parser()
    bad = []
    for c in cmds:
        try:
            parser.parse_args(shlex.split(c))
        except SystemExit:
            bad.append(c)
    assert not bad, f"README commands the CLI refuses: {bad}"


MEASURED = re.compile(r"(?i)\bmeasured\b[^.;\n]*\d\.\d"
                      r"|\b(AUC|accuracy|loss)\s+(stuck at\s+|of\s+|reached\s+)?0\.\d{2,}|\breached\s+0\.\d{2,}")


def _product_docstrings():
    import ast

    for pkg in ("chest_xray", "hfl_components", "nvflare_jobs"):
        for f in sorted((REPO / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc:
                        yield f"{f.relative_to(REPO)}:{getattr(node, 'name', '<module>')}", doc


def test_docstrings_hold_no_measured_numbers_or_research_process_residue():
    """Numbers live in results files and decisions in docs/decisions.md; a docstring says what code does."""
    assert MEASURED.search("(measured on chest X-rays: loss stuck at 0.67 for 6 epochs)")
    assert MEASURED.search("the deep cnn at 96 px reached 0.93 test accuracy")
    assert not MEASURED.search("Adam lr 0.001, log-loss of the class layer, tolerance 0.05; measured after layer k")
    found = [f"{where}: {r}" for where, doc in _product_docstrings()
             for r in residue(doc) + [f"a measured number: {m.group(0)!r}"  # ``literal`` examples of output aside
                                      for m in MEASURED.finditer(re.sub(r"``.*?``", "", doc, flags=re.S))]
             if not r.startswith("a paper file number")]
    assert not found, "\n".join(found)


def test_test_docstrings_and_comments_say_what_is_tested_not_which_issue():
    """A test's docstring or comment names what it checks; "issue N" means nothing to a reader of the repository.
    String literals (like the residue examples above) are data and not looked at."""
    import ast
    import io
    import tokenize

    issue = RESIDUE['"issue N"']
    found = []
    for f in sorted((REPO / "tests").glob("*.py")):
        text = f.read_text(encoding="utf-8")
        docs = [ast.get_docstring(n) or "" for n in ast.walk(ast.parse(text))
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        tokens = tokenize.generate_tokens(io.StringIO(text).readline)
        comments = [t.string for t in tokens if t.type == tokenize.COMMENT]
        found += [f"{f.name}: {m.group(0)!r}" for s in docs + comments for m in issue.finditer(s)]
    assert not found, "\n".join(found)


def test_no_doc_repeats_a_paragraph():
    """No paragraph of README.md or docs/*.md opens with the same sentence as another paragraph of the same file
    (a paragraph pasted twice, perhaps reworded later); tables, code, headings and list items are left out."""
    for f in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        paras = [re.sub(r"\s+", " ", p).strip() for p in re.split(r"\n\s*\n", f.read_text(encoding="utf-8"))]
        firsts = [re.split(r"(?<=[.;:])\s", p)[0] for p in paras if p and not p.startswith(("|", "```", "#", "-", "*"))]
        twice = sorted({s for s in firsts if len(s) > 40 and firsts.count(s) > 1})
        assert not twice, f"{f.relative_to(REPO)} repeats the paragraph opening {twice[0]!r}"


def test_simulate_help_shows_the_default_of_every_option():
    """Every option of `cxr-hfl simulate --help` (but the required ones and plain on/off flags) says its default,
    and an option with a fixed parser default shows that value (it had none for --scheme, --alpha, --batch-size,
    --seed, --feature-dim)."""
    from nvflare_jobs.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    p = sub.choices["simulate"]
    lacking, wrong = [], []
    for a in p._actions:
        if a.required or a.default == argparse.SUPPRESS or (a.nargs == 0 and not isinstance(
                a, argparse.BooleanOptionalAction)):
            continue
        text = " ".join((a.help or "").split())
        if not re.search(r"(?i)\bdefault\b", text):
            lacking.append(a.option_strings[0])
        elif a.default not in (None, []):  # "(default 16)", "(default fedsaf fedproto, ...)", "tensorboard (default;"
            v = re.escape(str(a.default))
            if not re.search(rf"(?i)\bdefault\b[^()]{{0,40}}?\b{v}\b|\b{v} \(default\b", text):
                wrong.append((a.option_strings[0], a.default))
    assert not lacking, f"simulate --help: options without their default: {lacking}"
    assert not wrong, f"simulate --help: options whose help does not show the parser default: {wrong}"


def test_site_configuration_doc_gives_site_checks_exit_codes():
    """The doc said site check "exits with 1 on errors"; an invalid config exits 2 (the command's --help says so)."""
    doc = " ".join((REPO / "docs" / "site_configuration.md").read_text(encoding="utf-8").split())
    assert "exits with 1 when the data or the model has errors" in doc
    assert "with 2, in one line naming the site, the file and the key, when the config is invalid" in doc
