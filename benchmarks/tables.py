"""Every results table and measured figure in the docs, generated from the stored results.

    python benchmarks/tables.py           # rewrite the generated parts of README.md, benchmarks/ and docs/
    python benchmarks/tables.py --check   # exit 0 when the docs match the results, 1 with a diff
    python benchmarks/tables.py --list    # the names a doc can use, and the file each reads

A generated part sits between ``<!-- results: NAME -->`` and ``<!-- /results -->``: on lines of
their own for a table, inside a sentence for one figure. What is between them is replaced by what
``NAME`` renders from ``benchmarks/results/`` (``views/``); everything else is left as written.
A figure typed by hand drifts from the run it came from; one rendered from the results file cannot.

The pictures (``docs/*.png``, ``benchmarks/results/**/*.png``) are drawn from the same results and
carry the data they plot (``views/plots.py``): ``--check`` compares it with the results, with the
standard library alone; a rewrite draws again, with matplotlib, only the pictures that differ.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The views read this checkout's own modules (``vllm_mtp_plugin/tools/stats.py``, ...: the
# standard library only), so a plain clone renders and checks the docs with no install, no
# PYTHONPATH and no third-party package (``tests/unit/repo/test_prose_numbers.py`` runs it so).
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from views import VIEWS, plots  # noqa: E402  (benchmarks/views/, beside this file)

DOCS = ("README.md", "benchmarks/README.md", "docs/*.md")
PART = re.compile(r"<!-- results: (?P<name>[\w.:-]+) -->(?P<body>.*?)<!-- /results -->", re.S)
OPENER = re.compile(r"<!-- results: ([^>]*?) -->")


class DocError(ValueError):
    """A doc's markers that cannot be rendered: names the file, the line and what to fix."""


def doc_files(root: Path = ROOT) -> list[Path]:
    return sorted({p for pattern in DOCS for p in root.glob(pattern)})


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def render_doc(text: str, where: str, views=VIEWS) -> str:
    """``text`` with every generated part rendered afresh."""
    openers = [(m.start(), m.group(1)) for m in OPENER.finditer(text)]
    parts = list(PART.finditer(text))
    if len(openers) != len(parts) or text.count("<!-- /results -->") != len(parts):
        starts = {m.start() for m in parts}
        bad = next((o for o in openers if o[0] not in starts), None)
        line = _line(text, bad[0]) if bad else 1
        raise DocError(f"{where}:{line}: a '<!-- results: NAME -->' without its "
                       f"'<!-- /results -->' (or the other way round)")
    out, last = [], 0
    for m in parts:
        name, body = m.group("name"), m.group("body")
        if name not in views:
            raise DocError(f"{where}:{_line(text, m.start())}: unknown results part '{name}' "
                           f"(python benchmarks/tables.py --list names them)")
        rendered = views[name].render().strip("\n")
        inline = "\n" not in body
        if inline and "\n" in rendered:
            raise DocError(f"{where}:{_line(text, m.start())}: '{name}' is a table: put its markers "
                           f"on lines of their own")
        out += [text[last:m.start()], f"<!-- results: {name} -->",
                rendered if inline else f"\n{rendered}\n", "<!-- /results -->"]
        last = m.end()
    return "".join(out + [text[last:]])


def run(check: bool, root: Path = ROOT) -> int:
    stale = []
    for path in doc_files(root):
        text = path.read_text()
        where = path.relative_to(root).as_posix()
        new = render_doc(text, where)
        if new == text:
            continue
        stale.append(where)
        if check:
            sys.stdout.writelines(difflib.unified_diff(
                text.splitlines(True), new.splitlines(True), f"{where} (as written)",
                f"{where} (from the results)"))
        else:
            path.write_text(new)
            print(f"rewrote {where}")
    pictures = plots.refresh(check) if root == ROOT else []  # the checkout's own pictures
    if pictures:
        print("\n".join(pictures))
        print(f"{len(pictures)} picture(s) drawn from other data than benchmarks/results: "
              f"python benchmarks/tables.py draws them (with matplotlib)")
    if check and stale:
        print(f"\n{len(stale)} doc(s) differ from benchmarks/results: run python benchmarks/tables.py")
    return 1 if check and (stale or pictures) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 with a diff "
                        "where a doc differs from the results")
    parser.add_argument("--list", action="store_true", help="the parts a doc can name")
    args = parser.parse_args(argv)
    if args.list:
        for name, view in sorted(VIEWS.items()):
            print(f"{name:34} {', '.join(view.sources)}")
        return 0
    try:
        return run(args.check)
    except DocError as exc:
        print(f"tables: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
