"""``vllm-mtp bench --impl adaptive``: the plugin with k chosen per step up to each -k, beside
fixed k in one run (the arm adaptive k's proof compares, docs/adaptive-k.md)."""

from vllm_mtp_plugin.tools.bench.serve_mode import server_env
from vllm_mtp_plugin.tools.bench.sweep import Sweep
from vllm_mtp_plugin.tools.engine.offline import child_env


def test_adaptive_rows_beside_fixed_k_without_a_k0_of_their_own():
    configs = Sweep(checkpoints=["x"], impls=["plugin", "adaptive"], ks=[0, 2, 3],
                    floor=False).configs()
    assert [(c.impl, c.k) for c in configs] == [("plugin", 0), ("plugin", 2), ("plugin", 3),
                                                ("adaptive", 2), ("adaptive", 3)]
    assert configs[-1].label() == "x adaptive k=3 c=1"


def test_the_switch_reaches_adaptive_engines_only():
    exported = {"VLLM_MTP_ADAPTIVE_K": "1"}
    assert child_env("adaptive", {})["VLLM_MTP_ADAPTIVE_K"] == "1"
    assert child_env("adaptive", {})["MTP_PLUGIN"] == "auto"
    assert "VLLM_MTP_ADAPTIVE_K" not in child_env("plugin", exported)
    assert server_env("adaptive")["VLLM_MTP_ADAPTIVE_K"] == "1"
    assert server_env("plugin")["VLLM_MTP_ADAPTIVE_K"] == "0"


def test_the_implementations_picture_is_named_for_what_it_compares():
    """A run of the plugin against adaptive k is not drawn as "plugin vs in-tree"."""
    from vllm_mtp_plugin.tools.bench.report import implementations_picture

    assert implementations_picture(["plugin", "in-tree"]) == (
        "plugin_vs_in_tree.png", "Plugin vs vLLM's in-tree MTP")
    assert implementations_picture(["plugin", "in-tree", "vllm"])[0] == "plugin_vs_in_tree.png"
    assert implementations_picture(["plugin", "adaptive"]) == (
        "by_implementation.png", "Output tokens/s by implementation: plugin, adaptive")
    assert implementations_picture(["plugin", "in-tree", "adaptive"])[0] == "by_implementation.png"


def test_adaptive_rows_only_up_to_the_named_k():
    configs = Sweep(checkpoints=["x"], impls=["plugin", "adaptive"], ks=[0, 1, 2, 3],
                    floor=False, adaptive_ks=[3]).configs()
    assert [(c.impl, c.k) for c in configs] == [("plugin", 0), ("plugin", 1), ("plugin", 2),
                                                ("plugin", 3), ("adaptive", 3)]


def test_an_adaptive_k_outside_the_sweep_is_refused_by_the_command(capsys):
    import pytest

    from vllm_mtp_plugin.tools.bench.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["offline", "-k", "0", "3", "--impl", "plugin", "adaptive", "--adaptive-k", "2"])
    assert str(exc.value) == "vllm-mtp bench: adaptive_ks [2] must name k > 0 of ks [0, 3]"
    with pytest.raises(SystemExit) as exc:
        main(["offline", "-k", "0", "-1"])
    assert "k must be >= 0" in str(exc.value)
    with pytest.raises(SystemExit) as exc:
        main(["offline", "-k", "0", "3", "--adaptive-k", "3"])
    assert "add adaptive to impls" in str(exc.value)


def test_decode_steps_by_the_k_they_drafted_per_run_and_per_row():
    """What adaptive k chose and what each choice cost: prefills and idle steps left out, counts
    summed over runs, step times the median of the runs' medians."""
    from vllm_mtp_plugin.tools.bench.analysis import finish_row
    from vllm_mtp_plugin.tools.engine.steptimer import by_drafted_k

    def step(k, ms, tokens=4, new=0):
        return {"tokens": tokens, "new_requests": new, "drafted_k": k,
                "execute_model": ms / 2e3, "sample_tokens": ms / 2e3}

    first = by_drafted_k([step(3, 9.0, new=2), step(3, 6.0), step(0, 3.0), step(0, 5.0),
                          step(0, 4.0), step(1, 2.0, tokens=0), step(None, 1.0)])
    assert first == {"0": {"steps": 3, "step_ms": 4.0}, "3": {"steps": 1, "step_ms": 6.0}}
    second = by_drafted_k([step(0, 2.0), step(2, 7.0)])
    row = finish_row({}, [{"process": 0, "output_tok_s": 1.0, "by_drafted_k": first},
                          {"process": 1, "output_tok_s": 1.0, "by_drafted_k": second}])
    assert row["by_drafted_k"] == {"0": {"steps": 4, "step_ms": 3.0},
                                   "2": {"steps": 1, "step_ms": 7.0},
                                   "3": {"steps": 1, "step_ms": 6.0}}
    assert "by_drafted_k" not in finish_row({}, [{"process": 0, "output_tok_s": 1.0}])


def test_warmup_runs_whole_batches_of_the_measured_concurrency():
    from vllm_mtp_plugin.tools.bench.offline_mode import warmup_prompts
    from vllm_mtp_plugin.tools.bench.serve_mode import cycled

    assert warmup_prompts(1, 16) == 16
    assert warmup_prompts(8, 4) == 32
    assert warmup_prompts(0, 16) == 0
    assert cycled(["a", "b", "c"], 7) == ["a", "b", "c", "a", "b", "c", "a"]
