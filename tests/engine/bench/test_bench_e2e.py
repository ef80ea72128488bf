"""``vllm-mtp bench`` end to end on tiny checkpoints: the JSON's fields and oracle acceptance 1.0."""

import json

import pytest
from support.vllm_cache import private_cache_root

from vllm_mtp_plugin.tools.bench.cli import main
from vllm_mtp_plugin.tools.provenance import local_path

pytestmark = pytest.mark.engine  # starts vLLM (tests/conftest.py, the engine marker)

ROW_FIELDS = ("checkpoint", "impl", "k", "concurrency", "output_tok_s", "speedup",
              "acceptance_rate", "mean_acceptance_length", "per_position_acceptance", "ttft_ms",
              "tpot_ms", "draft_bytes", "ideal_speedup", "measured_over_ideal", "runs")


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-offline")
    code = main(["offline", "-m", "tiny:oracle", "-k", "0", "2", "--impl", "plugin", "in-tree",
                 "--num-prompts", "2", "--max-tokens", "12", "--repeats", "2", "--processes", "1",
                 "--enforce-eager", "--cache-dir", str(out / "cache"), "--out", str(out),
                 "--disturbed-retries", "0"])  # counters are asserted, not timings
    assert code == 0
    return out, json.loads((out / "results.json").read_text())


def test_offline_rows_and_fields(offline):
    out, data = offline
    rows = {(r["impl"], r["k"]): r for r in data["results"] if not r["floor_only"]}
    assert sorted(rows) == [("in-tree", 0), ("in-tree", 2), ("plugin", 0), ("plugin", 2)]
    for row in rows.values():
        assert all(field in row for field in ROW_FIELDS), row.keys()
        assert len(row["runs"]) == 2 and row["output_tok_s"] > 0
        assert all(run["output_tokens"] == 2 * 12 for run in row["runs"])
        assert row["ttft_ms"]["p50"] > 0 and row["tpot_ms"]["p99"] > 0
    assert data["settings"]["ks"] == [0, 2] and data["environment"]["cpus"] >= 1
    for name in ("table.md", "per_position_acceptance.png", "speedup_vs_k.png",
                 "plugin_vs_in_tree.png"):
        assert (out / name).stat().st_size > 0
    table, floor = (out / "table.md").read_text().split("\n\nmachine: ")
    assert table.startswith("Engines: eager.\n") and len(table.splitlines()) == 2 + 2 + 5
    assert "| tiny-oracle | plugin | all (floor) | 0 | 0 | 3 |" in table
    assert floor.startswith(data["environment"]["cpu"]) and floor.count("| tiny-oracle |") == 2


def test_floor_is_a_full_batch_of_k_plus_1_rows(offline):
    """k = 2 at concurrency 1: the floor is a k = 0 engine with 3 requests in flight (the 2
    prompts repeated), every decode step 3 rows; both k = 2 rows are measured against it."""
    _, data = offline
    (floor,) = [r for r in data["results"] if r["floor_only"]]
    assert (floor["k"], floor["concurrency"], floor["num_prompts"]) == (0, 3, 3)
    assert all(run["output_tokens"] == 3 * 12 for run in floor["runs"])
    assert floor["steps"]["tokens_per_step"] == 3
    for row in (r for r in data["results"] if r["k"] == 2):
        assert row["floor_rows"] == 3 and row["mla_verify"] == "on"
        assert row["floor_ratio"] == pytest.approx(
            floor["steps"]["step_ms"] / row["baseline"]["step_ms"])
        assert row["verify_over_floor"] == pytest.approx(
            row["steps"]["target_ms"] / floor["steps"]["step_ms"])
        assert row["payoff_bound"] == pytest.approx(3 / row["break_even_acceptance_length"])


def test_oracle_checkpoint_accepts_everything(offline):
    _, data = offline
    for row in data["results"]:
        if row["k"] == 0:
            assert row["acceptance_rate"] is None
            if row["floor_only"]:
                continue
            assert row["speedup"] == pytest.approx(row["output_tok_s"]
                                                   / row["baseline"]["output_tok_s"])
            assert row["baseline"]["processes"] == 2  # plugin and in-tree k=0 pooled
            continue
        assert row["acceptance_rate"] == 1.0
        assert row["mean_acceptance_length"] == 3.0
        assert row["per_position_acceptance"] == [1.0, 1.0]
        assert row["steps"]["decode_steps"] > 0 and row["steps"]["draft_ms"] > 0
        assert row["draft_cost_ratio"] > 0 and row["ideal_speedup"] > 0
        assert row["measured_over_ideal"] == pytest.approx(row["speedup"] / row["ideal_speedup"])


def test_report_mode_recomputes_from_the_json(offline, tmp_path, capsys):
    out, data = offline
    assert main(["report", "--results", str(out / "results.json"), "--out", str(tmp_path),
                 "--no-plots"]) == 0
    again = json.loads((tmp_path / "results.json").read_text())["results"]
    for before, after in zip(data["results"], again):
        for field in ("output_tok_s", "speedup", "acceptance_rate", "ideal_speedup", "steps"):
            assert after[field] == before[field]
    assert "| tiny-oracle | plugin | all | 0 | 2 |" in capsys.readouterr().out


def test_draft_memory_ours_vs_in_tree(offline):
    _, data = offline
    spec = {r["impl"]: r for r in data["results"] if r["k"] == 2}
    assert spec["plugin"]["drafter_class"].startswith("vllm_mtp_plugin.")
    assert spec["in-tree"]["drafter_class"].startswith("vllm.model_executor.models.")
    # vLLM's class allocates its own embedding and head (vocab x hidden fp32 each); ours does not.
    # results.json stores paths portably ($TMP/..., tools/provenance.py)
    meta = json.loads((local_path(spec["plugin"]["checkpoint_path"])
                       / "tiny_meta.json").read_text())["arch"]
    vocab_matrices = 2 * meta["vocab_size"] * meta["hidden_size"] * 4
    assert spec["in-tree"]["draft_bytes"] - spec["plugin"]["draft_bytes"] == vocab_matrices


def test_serve_mode_with_vllm_bench_serve_cross_check(tmp_path):
    code = main(["serve", "-m", "tiny:noisy:0.6", "-k", "2", "--impl", "plugin",
                 "--num-prompts", "3", "--max-tokens", "10", "--repeats", "1", "--cross-check",
                 "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path), "--no-plots"])
    (row,) = json.loads((tmp_path / "results.json").read_text())["results"]
    assert code == 0
    assert row["mode"] == "serve" and row["runs"][0]["output_tokens"] == 3 * 10
    assert 0 < row["acceptance_rate"] < 1
    assert row["ttft_ms"]["mean"] > 0 and row["tpot_ms"]["p50"] is not None
    check = row["cross_check"]
    assert check["agree"]
    assert check["vllm_bench_serve"]["completed"] == 3
    assert check["vllm_bench_serve"]["num_drafts"] == row["spec_decode"]["num_drafts"]
    assert "Speculative Decoding" in check["vllm_bench_serve"]["printed"]


def test_trained_model_compiled_by_prompt_kind_and_temperature(tmp_path, monkeypatch):
    """The README's headline configuration, small: vLLM's default compilation, the trained
    model's code/prose/chat prompts (chat through its template), greedy and sampled."""
    # shared by its engines only
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(private_cache_root(tmp_path / "vllm-cache")))
    code = main(["offline", "-m", "trained", "-k", "2", "--impl", "plugin", "in-tree",
                 "--temperature", "0", "1", "--num-prompts", "2", "--max-tokens", "16",
                 "--repeats", "1", "--processes", "1", "--no-floor", "--disturbed-retries", "0",
                 "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path), "--no-plots"])
    assert code == 0
    rows = json.loads((tmp_path / "results.json").read_text())["results"]
    by_key = {(r["impl"], r["k"], r["prompts"], r["temperature"]): r for r in rows}
    assert len(rows) == len(by_key) == 2 * 3 * 2
    for kind in ("code", "prose", "chat"):
        for temperature in (0.0, 1.0):
            plugin, tree = (by_key[(impl, 2, kind, temperature)] for impl in ("plugin", "in-tree"))
            assert plugin["compilation"] == "vLLM default (compiled)"
            assert plugin["runs"][0]["output_tokens"] == 2 * 16
            assert plugin["vs_in_tree"] > 0 and plugin["speedup"] is None  # no k = 0 measured
            assert 0 < plugin["spec_decode"]["num_drafts"] <= 2 * 16
            assert [len(ids) for ids in plugin["token_ids"]] == [16, 16]
            if temperature == 0:  # greedy: both drafters propose the same tokens
                assert plugin["spec_decode"] == tree["spec_decode"], kind
                assert plugin["token_ids"] == tree["token_ids"], kind
    logs = [p.read_text(errors="replace") for p in (tmp_path / "logs").glob("*.log")]
    # skip_unloadable_aot_cache (patches/skip_unloadable_aot_cache.py): no engine saves an artifact it could not load, and later
    # engines of the same target load nothing
    assert len(logs) == 2 and not any("saved AOT compiled function" in log for log in logs)
    assert not any("due to a load failure" in log for log in logs)
    assert "| trained | plugin | chat | 1 | 2 |" in (tmp_path / "table.md").read_text()
