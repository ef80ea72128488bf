"""``vllm-mtp doctor`` without a model: the plugin checked on this machine, as it serves here.

Tiny DeepSeek-V3 checkpoints built on the spot (``tiny/v3.py``): one target, with MTP layers that
are right by construction (oracle), 70 % right (noisy), or right at one layer of two only. The
target's head is halved, which keeps every greedy token and spreads its distribution at T = 1
(the right token about half the time) for the sampling check. Engines run in this platform's
default mode (``platform_facts.engine_mode``), one per configuration, each in a process of its own
(``engine/offline.py``). The one-layer checkpoints are served from one directory in turn: vLLM
keys its compile cache by path and config, not weights, so their engines compile the target's
graph once. What each check asserts:

* ``plugin-serves``: the engine built the plugin's drafter class (named by the engine itself).
* ``oracle-k1..3``: a drafter right by construction: every draft accepted, and the output
  identical to the target alone (k = 0).
* ``noisy-lossless``: a 70 %-right drafter, k = 2: output identical to k = 0.
* ``plugin-equals-in-tree``: the same engine with vLLM's own drafter class (``MTP_PLUGIN=off``):
  identical tokens and every spec-decode counter.
* ``layer-per-step``: two MTP layers, the first right by construction and the second random; the
  acceptance at draft position 2 says which layer drafted step 2 (V1 runner: layer L again, all
  accepted; Model Runner V2: layer L + 1, almost none) and that must be this runner's rule.
* ``sampling-t1``: T = 1 with MTP (noisy, k = 2) and without: the token each of
  ``SAMPLED_SEEDS`` seeded requests draws at output positions 2 to 4, per prompt, compared by a
  chi-square test of homogeneity: rejection sampling keeps the target's distribution, a broken
  sampler does not.
* ``tensor-parallel``: with two devices, the noisy run at TP = 2: tokens and counters as at TP = 1.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from ..engine.offline import OfflineConfig, run_config
from .checks import Check, check
from .sampling import homogeneity

K_ORACLE = (1, 2, 3)
K = 2  # the noisy, two-layer, sampling and tensor-parallel runs
NOISY_ACCEPTANCE = 0.7
MAX_TOKENS = 32
SAMPLED_PROMPTS = 4
SAMPLED_SEEDS = 48
SAMPLED_MAX_TOKENS = 6
SAMPLED_POSITIONS = (2, 3, 4)  # output positions whose tokens a draft can have decided
P_FAIL = 1e-3  # sampling-t1 fails below this p-value: a healthy engine fails 1 run in 1000


# The target's head (and the layers' copies) times this: greedy tokens unchanged (a power of two
# scales exactly), the right token drawn about half the time at T = 1 instead of always.
SOFT_HEAD = 0.5


@dataclasses.dataclass
class Checkpoints:
    served: Path  # the one directory the one-layer checkpoints are served from, in turn
    weights: dict[str, Path]  # "oracle", "noisy": their model.safetensors
    two_layers: Path
    first_mtp_layer: int


def build_checkpoints(work: Path, dtype: str) -> Checkpoints:
    """The oracle and noisy checkpoints (one target: same preset and seed) and the two-layer one,
    heads softened."""
    import shutil

    from ..tiny.v3 import PRESETS, build_checkpoint

    weights = {}
    for mode in ("oracle", "noisy"):
        built = build_checkpoint(work / "variants" / mode, "tiny", mode, 0, NOISY_ACCEPTANCE, dtype)
        _edit_tensors(built / "model.safetensors", _soften_head)
        weights[mode] = built / "model.safetensors"
    served = work / "served"
    shutil.copytree(work / "variants" / "oracle", served, dirs_exist_ok=True)
    two = build_checkpoint(work / "two-layers", "tiny", "oracle", 0, dtype=dtype,
                           num_nextn_predict_layers=2)
    first = PRESETS["tiny"].num_hidden_layers
    _edit_tensors(two / "model.safetensors", _soften_head,
                  _random_eh_proj(f"model.layers.{first + 1}.eh_proj.weight"))
    return Checkpoints(served, weights, two, first)


def _edit_tensors(path: Path, *edits) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    for edit in edits:
        edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _soften_head(tensors: dict) -> None:
    for name in list(tensors):
        if name == "lm_head.weight" or name.endswith("shared_head.head.weight"):
            tensors[name] = tensors[name] * SOFT_HEAD


def _random_eh_proj(name: str):
    """Make one MTP layer draft at random: its ``eh_proj`` no longer passes the embedding on."""
    def edit(tensors: dict) -> None:
        import torch

        weight = tensors[name]
        generator = torch.Generator().manual_seed(1)
        tensors[name] = (torch.randn(weight.shape, generator=generator) / weight.shape[1] ** 0.5
                         ).to(weight.dtype)

    return edit


@dataclasses.dataclass
class Plan:
    config: OfflineConfig
    weights: Path | None = None  # copied into the served directory before the engine starts
    env: dict = dataclasses.field(default_factory=dict)  # over the engine's environment


def cpu_thread_binding(ranks: int) -> dict[str, str]:
    """On a CPU, tensor-parallel ranks need their cores named unless the CPUs span a NUMA node
    per rank (vLLM: "Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"): the
    allowed cores split into ``ranks`` groups, ``VLLM_CPU_OMP_THREADS_BIND="0|1"`` on 2 cores.
    Nothing where the user set it, or off CPUs."""
    import os

    from ...platform import platform_family

    if ranks < 2 or "VLLM_CPU_OMP_THREADS_BIND" in os.environ or platform_family() != "cpu":
        return {}
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < ranks:
        return {}
    per = len(cores) // ranks
    groups = [cores[i * per:(i + 1) * per] for i in range(ranks)]
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(
        f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)}


def engine_plans(cp: Checkpoints, dtype: str, prompts: list[str],
                 tensor_parallel: int) -> dict[str, Plan]:
    """Every engine the checks need, by name."""
    greedy = {"label": "greedy", "prompts": prompts}
    sampled = {"label": "t1", "prompts": [p for p in prompts[:SAMPLED_PROMPTS]
                                          for _ in range(SAMPLED_SEEDS)],
               "sampling": {"temperature": 1.0, "seed": 0, "max_tokens": SAMPLED_MAX_TOKENS}}

    def plan(weights: str | None, k: int, passes: list, impl: str = "plugin",
             llm_kwargs: dict | None = None, env: dict | None = None) -> Plan:
        model = cp.served if weights else cp.two_layers
        return Plan(OfflineConfig(model=str(model), num_speculative_tokens=k, impl=impl,
                                  prompts=passes[0]["prompts"], passes=passes,
                                  max_tokens=MAX_TOKENS,
                                  llm_kwargs={"dtype": dtype, **(llm_kwargs or {})},
                                  default_process_mode=True),
                    cp.weights[weights] if weights else None, env or {})

    plans = {"target": plan("noisy", 0, [greedy, sampled])}
    for k in K_ORACLE:
        plans[f"oracle-k{k}"] = plan("oracle", k, [greedy])
    plans["noisy"] = plan("noisy", K, [greedy, sampled])
    plans["noisy-in-tree"] = plan("noisy", K, [greedy], impl="in-tree")
    plans["two-layers"] = plan(None, K, [greedy])
    if tensor_parallel > 1:
        plans["noisy-tp"] = plan("noisy", K, [greedy],
                                 llm_kwargs={"tensor_parallel_size": tensor_parallel},
                                 env=cpu_thread_binding(tensor_parallel))
    return plans


def run_engines(plans: dict[str, Plan], served: Path, log_dir: Path, timeout: float,
                progress=print) -> dict[str, dict]:
    """Each plan's report, or ``{"error": ...}`` with the last lines of its log."""
    import shutil

    results = {}
    for name, plan in plans.items():
        started = time.monotonic()
        try:
            if plan.weights is not None:
                shutil.copyfile(plan.weights, served / "model.safetensors")
            results[name] = run_config(plan.config, timeout=timeout,
                                       log_path=str(log_dir / f"{name}.log"), env=plan.env)
            results[name]["wall_s"] = time.monotonic() - started
        except Exception as exc:  # one broken engine fails its checks, not the whole report
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[-2000:],
                             "wall_s": time.monotonic() - started}
        progress(f"  engine {name}: {results[name]['wall_s']:.0f} s"
                 + (" FAILED" if "error" in results[name] else ""), flush=True)
    return results


def _pass(report: dict, label: str) -> dict:
    """The report with its tokens and counters taken from the pass ``label`` (an engine runs a
    greedy pass and maybe a sampled one; the report's own are its last pass's)."""
    if "error" in report:
        return report
    run = next(r for r in report["runs"] if r.get("pass") == label)
    return {**report, "token_ids": run["token_ids"], "spec_decode": run["spec_decode"]}


def _counters(result: dict) -> dict:
    return {k: result["spec_decode"][k] for k in ("num_drafts", "num_draft_tokens",
                                                 "num_accepted_tokens", "accepted_per_position")}


def _failed(name: str, *results: dict) -> Check | None:
    broken = next((r for r in results if "error" in r), None)
    if broken is None:
        return None
    return Check(name, "fail", "an engine failed: " + broken["error"].strip().splitlines()[-1],
                 {"error": broken["error"]})


def evaluate(reports: dict[str, dict], cp: Checkpoints) -> list[Check]:
    """The checks, from the engines' reports."""
    out: list[Check] = []
    results = {name: _pass(r, "greedy") for name, r in reports.items()}
    target = results["target"]

    noisy = results["noisy"]
    out.append(_failed("plugin-serves", noisy) or _plugin_serves(noisy))
    for k in K_ORACLE:
        name, run = f"oracle-k{k}", results[f"oracle-k{k}"]
        out.append(_failed(name, run, target) or _oracle(name, k, run, target))
    out.append(_failed("noisy-lossless", noisy, target) or _lossless("noisy-lossless", noisy, target))
    in_tree = results["noisy-in-tree"]
    out.append(_failed("plugin-equals-in-tree", noisy, in_tree)
               or _equal_engines("plugin-equals-in-tree", noisy, in_tree, "vLLM's class"))
    two = results["two-layers"]
    out.append(_failed("layer-per-step", two, target) or _layer_per_step(two, target, cp))
    out.append(_failed("sampling-t1", noisy, target)
               or _sampling(_pass(reports["target"], "t1"), _pass(reports["noisy"], "t1")))
    if "noisy-tp" in results:
        tp = results["noisy-tp"]
        out.append(_failed("tensor-parallel", tp, noisy)
                   or _equal_engines("tensor-parallel", tp, noisy, "TP = 1"))
    return out


def _plugin_serves(run: dict) -> Check:
    drafter = (run.get("drafter") or {}).get("class") or "none"
    ok = bool(run.get("plugin_registered")) and drafter.startswith("vllm_mtp_plugin.")
    return check("plugin-serves", ok, f"drafter {drafter} on runner {run.get('runner')}, "
                 f"compilation {run.get('compilation')}", drafter=drafter,
                 runner=run.get("runner"), compilation=run.get("compilation"),
                 plugin_registered=run.get("plugin_registered"), engine_s=run.get("wall_s"))


def _oracle(name: str, k: int, run: dict, target: dict) -> Check:
    c = _counters(run)
    all_accepted = (c["num_drafts"] > 0 and c["num_accepted_tokens"] == c["num_draft_tokens"]
                    == k * c["num_drafts"])
    same = run["token_ids"] == target["token_ids"]
    return check(name, all_accepted and same,
                 f"{int(c['num_accepted_tokens'])}/{int(c['num_draft_tokens'])} drafts accepted, "
                 f"output {'identical to' if same else 'DIFFERS from'} k = 0", **c,
                 identical_to_k0=same, engine_s=run.get("wall_s"))


def _lossless(name: str, run: dict, target: dict) -> Check:
    c = _counters(run)
    same = run["token_ids"] == target["token_ids"]
    rate = c["num_accepted_tokens"] / c["num_draft_tokens"] if c["num_draft_tokens"] else None
    return check(name, same and c["num_drafts"] > 0,
                 f"output {'identical to' if same else 'DIFFERS from'} k = 0 with "
                 f"{int(c['num_accepted_tokens'])}/{int(c['num_draft_tokens'])} drafts accepted"
                 + (f" ({rate:.2f})" if rate is not None else ""), **c, acceptance_rate=rate,
                 identical_to_k0=same, engine_s=run.get("wall_s"))


def _equal_engines(name: str, run: dict, other: dict, other_label: str) -> Check:
    tokens = run["token_ids"] == other["token_ids"]
    counters = _counters(run) == _counters(other)
    what = [w for w, ok in (("tokens", tokens), ("counters", counters)) if not ok]
    return check(name, tokens and counters,
                 (f"tokens and every counter identical to {other_label}" if not what else
                  f"{' and '.join(what)} differ from {other_label}"),
                 counters=_counters(run), other_counters=_counters(other),
                 other_drafter=(other.get("drafter") or {}).get("class"),
                 identical_tokens=tokens, engine_s=run.get("wall_s"))


def expected_draft_layers(runner: str, first: int, k: int) -> list[int]:
    """The MTP layer that drafts each step: V1 runs layer L for every step (and feeds its output
    back), Model Runner V2 runs layer L + s at step s (``notes``: ``MultiModuleMTPSpeculator``)."""
    return [first + s if runner == "v2" else first for s in range(k)]


def _layer_per_step(run: dict, target: dict, cp: Checkpoints) -> Check:
    """Layer L is right by construction, L + 1 random: a step drafted by L is always accepted."""
    c = _counters(run)
    expected = expected_draft_layers(run["runner"], cp.first_mtp_layer, K)
    drafts = c["num_drafts"]
    rates = [a / drafts if drafts else 0.0 for a in c["accepted_per_position"]]
    # By L: every draft of that position accepted; by the random layer: (almost) none.
    seen = [cp.first_mtp_layer if rate == 1.0 else cp.first_mtp_layer + 1 if rate < 0.5 else None
            for rate in rates]
    same = run["token_ids"] == target["token_ids"]
    return check("layer-per-step", seen == expected and same and drafts > 0,
                 f"runner {run['runner']}: steps drafted by layers {seen} (expected {expected}), "
                 f"acceptance per position {', '.join(f'{r:.2f}' for r in rates)}; output "
                 f"{'identical to' if same else 'DIFFERS from'} k = 0", runner=run["runner"],
                 layers_seen=seen, layers_expected=expected, per_position=rates, **c,
                 engine_s=run.get("wall_s"))


def _sampling(base: dict, spec: dict) -> Check:
    """Per (prompt, output position): the tokens sampled by SAMPLED_SEEDS requests with MTP
    against those without."""
    groups_base, groups_spec = _position_groups(base), _position_groups(spec)
    result = homogeneity([(groups_base[key], groups_spec[key]) for key in sorted(groups_base)])
    c = _counters(spec)
    rate = c["num_accepted_tokens"] / c["num_draft_tokens"] if c["num_draft_tokens"] else None
    ok = result["p_value"] >= P_FAIL and c["num_drafts"] > 0
    return check("sampling-t1", ok,
                 f"T = 1: token distributions with and without MTP alike (chi-square p = "
                 f"{result['p_value']:.3g}, {result['samples']} samples per side; fails below "
                 f"{P_FAIL:g}); acceptance {rate:.2f}" if ok else
                 f"T = 1: token distributions with MTP differ from without (chi-square p = "
                 f"{result['p_value']:.3g} < {P_FAIL:g})", **result, **c, acceptance_rate=rate,
                 engine_s=spec.get("wall_s"))


def _position_groups(run: dict) -> dict[tuple[int, int], list[int]]:
    """Tokens by (prompt, output position): the sampled pass repeats each prompt SAMPLED_SEEDS
    times with seeds seed + i."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, tokens in enumerate(run["token_ids"]):
        for position in SAMPLED_POSITIONS:
            if position < len(tokens):
                groups.setdefault((i // SAMPLED_SEEDS, position), []).append(tokens[position])
    return groups

