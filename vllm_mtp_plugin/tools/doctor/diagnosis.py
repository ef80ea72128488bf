"""``vllm-mtp doctor MODEL``: why is this checkpoint's acceptance what it is.

1. The start-up check and ``inspect``'s findings (headers only): is there a DeepSeek MTP layer,
   would vLLM load it.
2. A served probe: the checkpoint served with MTP (k = 1) in this platform's default engine mode
   with the user's engine arguments, greedy, on the prompts (a few hundred drafts): vLLM's
   counters.
3. The reference: ``vllm-mtp train``'s collection records what the drafter receives (and what the
   served layer returns) on the same prompts; the layer from the files is evaluated on it outside
   vLLM (``mtp_layer/evaluation.py``).
4. The verdict from the two (``verdict.py``), and advice on k and temperature from the reference.
5. Advice on batch size: k = 1 against no speculation at a few batch sizes (``batch.py``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from ..engine.offline import OfflineConfig, run_config
from .batch import DEFAULT_BATCH_SIZES, batch_advice, measure_batch_sizes
from .checks import Check, check
from .paired import pair
from .verdict import advice, decide

PROBE_K = 1
# The collecting engine sets these itself (eager, no prefix caching or chunked prefill: its
# recording needs every position of every prefill).
COLLECTION_SETS = ("enforce_eager", "enable_prefix_caching", "enable_chunked_prefill",
                   "max_model_len", "dtype", "speculative_config", "disable_log_stats",
                   "worker_extension_cls")


@dataclasses.dataclass
class DiagnosisSettings:
    prompts: Path
    max_tokens: int = 64
    engine_args: dict = dataclasses.field(default_factory=dict)
    depth: int = 3  # draft depths the reference evaluates (advice on k)
    timeout: float = 1800.0
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES  # empty: no batch-size measurement


def findings(model: Path) -> tuple[str, list[str], dict | None]:
    """The drafter kind, the start-up check's problems and ``inspect``'s report."""
    from ...weights.preflight import drafter_kind
    from ..checkpoint.report import inspect_checkpoint
    from ..checkpoint.target import TargetCheckpoint, TargetCheckpointError

    try:
        checkpoint = TargetCheckpoint(model)
    except TargetCheckpointError as exc:
        return "none", [str(exc)], None
    if checkpoint.layout is None:
        return "none", [f"{checkpoint.config_path}: model_type "
                        f"{checkpoint.config.get('model_type')!r} is no DeepSeek model with MTP "
                        "layers"], None
    report = inspect_checkpoint(model)
    return drafter_kind(checkpoint.tensors, checkpoint.config), report["problems"], report


def probe_config(model: Path, settings: DiagnosisSettings, prompts: list) -> OfflineConfig:
    """The served probe: k = 1, greedy, vLLM's default engine mode plus the user's arguments."""
    completions = [p for p in prompts if isinstance(p, str)]
    chats = [p for p in prompts if not isinstance(p, str)]
    passes = ([{"label": "completions", "prompts": completions}] if completions else []) + (
        [{"label": "chats", "prompts": chats, "chat": True}] if chats else [])
    args = dict(settings.engine_args)
    # Each request's drafts step by step, to pair them with the layer's own (``paired.py``).
    args.setdefault("per_request_spec_decode_metrics", "detailed")
    return OfflineConfig(model=str(model), num_speculative_tokens=PROBE_K,
                         prompts=passes[0]["prompts"], passes=passes,
                         max_tokens=settings.max_tokens, ignore_eos=False,
                         max_model_len=args.pop("max_model_len", None), llm_kwargs=args,
                         default_process_mode=True)


def user_process_mode() -> dict[str, str]:
    """The user's own choice of vLLM's process mode, kept for the probe's engine."""
    name = "VLLM_ENABLE_V1_MULTIPROCESSING"
    return {name: os.environ[name]} if name in os.environ else {}


def summed_counters(runs: list[dict]) -> dict:
    """The spec-decode counters of every pass of a report (completions and chats) together."""
    keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    total = {k: sum(r["spec_decode"][k] or 0 for r in runs) for k in keys}
    width = max((len(r["spec_decode"]["accepted_per_position"]) for r in runs), default=0)
    total["accepted_per_position"] = [
        sum((r["spec_decode"]["accepted_per_position"] + [0] * width)[i] for r in runs)
        for i in range(width)]
    return total


def counted(spec: dict) -> dict:
    """Acceptance of the first draft with its 95 % interval, from spec-decode counters."""
    from ..stats import wilson

    drafts, accepted = spec.get("num_drafts") or 0, (spec.get("accepted_per_position") or [0])[0]
    return {"drafts": drafts, "accepted": accepted,
            "acceptance": accepted / drafts if drafts else None,
            "interval": wilson(accepted, drafts)}


def collect_reference_data(model: Path, settings: DiagnosisSettings, work: Path,
                           log: Path) -> dict:
    """``vllm-mtp train``'s collection, greedy, with the served layer's output, in a process of
    its own (its engine's memory goes before the reference loads the layer)."""
    from ..state_collection import CollectJob, CollectSettings
    from ..job_files import write_job

    prompts_len = settings.engine_args.get("max_model_len")
    collect_settings = CollectSettings(temperature=0.0, max_new_tokens=settings.max_tokens,
                                       max_len=(prompts_len - 1) if prompts_len else 512,
                                       record_outputs=True)
    engine_kwargs = {k: v for k, v in settings.engine_args.items() if k not in COLLECTION_SETS}
    job = CollectJob(model_dir=str(model), prompts=str(settings.prompts),
                     data_dir=str(work / "data"), settings=collect_settings,
                     dtype=settings.engine_args.get("dtype", "auto"), engine_kwargs=engine_kwargs)
    write_job(job, work / "collect.json")
    with open(log, "w") as out:
        done = subprocess.run([sys.executable, "-m", "vllm_mtp_plugin.tools.state_collection",
                               str(work / "collect.json")], stdout=out, stderr=subprocess.STDOUT,
                              timeout=settings.timeout)
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"the reference's collection failed (exit {done.returncode}):\n{tail}")
    return json.loads((work / "data" / "manifest.json").read_text())


def engine_failure(exc: Exception, log: Path) -> str:
    """One line on why an engine failed: the last error line of its log, and where the log is
    (kept with ``--work-dir``)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    last = (errors or lines or [type(exc).__name__])[-1]
    return f"the engine failed: {last[-300:]} (log: {log}; keep it with --work-dir)"


def eager_counters(manifest: dict) -> dict:
    """The collecting engine's own drafts (k = 1, eager), summed over its shards."""
    drafts = sum((s.get("spec_decode") or {}).get("num_drafts") or 0 for s in manifest["shards"])
    accepted = sum(((s.get("spec_decode") or {}).get("accepted_per_position") or [0])[0]
                   for s in manifest["shards"])
    return counted({"num_drafts": drafts, "accepted_per_position": [accepted]})


def reference_unavailable(model: Path) -> str:
    """Why the reference cannot evaluate this checkpoint's layer (it runs transformers'
    DeepSeek-V3 modules, as ``vllm-mtp train`` does), or "" when it can."""
    from ..mtp_layer.v3_target import TrainInputError, open_target

    try:
        open_target(model)
    except TrainInputError as exc:
        return f"no reference: {exc}"
    return ""


def diagnose(model: Path, settings: DiagnosisSettings, work: Path, progress=print) -> dict:
    """Every step above; returns the report's ``checks``, ``verdict`` and figures."""
    from ..mtp_layer.drafter_inputs import load_training_prompts

    checks: list[Check] = []
    kind, problems, report = findings(model)
    checks.append(check("start-up-check", kind == "mtp" and not problems,
                        f"{kind}: " + ("the layer loads" if not problems else problems[0]),
                        drafter_kind=kind, problems=problems))
    result = {"model": str(model), "inspect": report, "drafter_kind": kind}
    if kind != "mtp" or problems:
        return {**result, "checks": checks, **decide(kind, problems, None, None, None, report)}
    prompts = load_training_prompts(settings.prompts)
    progress(f"served probe: k = {PROBE_K}, {len(prompts)} prompts x {settings.max_tokens} tokens")
    started = time.monotonic()
    try:
        run = run_config(probe_config(model, settings, prompts), timeout=settings.timeout,
                         log_path=str(work / "probe.log"), env=user_process_mode())
    except Exception as exc:  # the engine's own error is the finding: report it, do not crash
        why = engine_failure(exc, work / "probe.log")
        checks.append(check("served-probe", False, why, error=str(exc)[-4000:]))
        return {**result, "checks": checks,
                **decide(kind, problems, None, None, None, report, why)}
    probe = counted(summed_counters(run["runs"]))
    checks.append(check("served-probe", bool(probe["drafts"]),
                        f"drafter {(run.get('drafter') or {}).get('class')}, runner "
                        f"{run['runner']}, {run['compilation']}: first-draft acceptance "
                        + (f"{probe['acceptance']:.3f} over {probe['drafts']:.0f} drafts"
                           if probe["drafts"] else "- (no drafts)"),
                        **probe, runner=run["runner"], compilation=run["compilation"],
                        drafter=(run.get("drafter") or {}).get("class"),
                        seconds=time.monotonic() - started))
    reference, eager, reason = None, None, reference_unavailable(model)
    if not reason:
        from ..mtp_layer.evaluation import evaluate

        progress("reference: recording the drafter's inputs, then the layer from the files")
        started = time.monotonic()
        try:
            manifest = collect_reference_data(model, settings, work, work / "collect.log")
        except Exception as exc:  # as for the probe: the failure is reported, the verdict waits
            reason = engine_failure(exc, work / "collect.log")
            checks.append(check("reference", False, reason, error=str(exc)[-4000:]))
            return {**result, "checks": checks, "probe": probe,
                    **decide(kind, problems, probe, None, None, report, reason)}
        eager = eager_counters(manifest)
        unroll = "chained" if run["runner"] == "v2" else "recursive"
        reference = evaluate(model, work / "data", settings.depth, unroll, by_sequence=True)
        probe["paired"] = pair(reference.pop("by_sequence"), [
            request for r in run["runs"] for request in r.get("drafted_per_request") or []])
        own = reference["agreement"][0]
        checks.append(check("reference", own is not None,
                            f"the layer's own first-draft agreement {own:.3f} over "
                            f"{reference['positions']} positions" if own is not None else
                            "no continuation positions to evaluate",
                            **reference, eager_engine=eager, seconds=time.monotonic() - started))
    decision = decide(kind, problems, probe, reference, eager, report, reason)
    batch = measure_batch(model, settings, prompts, work, checks, progress)
    return {**result, "checks": checks, "probe": probe, "eager_probe": eager,
            "reference": reference, **decision, "batch_sizes": batch,
            "advice": advice(reference, probe) + batch_advice(batch)}


def measure_batch(model: Path, settings: DiagnosisSettings, prompts: list, work: Path,
                  checks: list[Check], progress) -> dict | None:
    """The batch-size measurement as a check of its own: a failure is reported, and changes no
    verdict."""
    if not settings.batch_sizes:
        return None
    progress(f"batch sizes {', '.join(map(str, settings.batch_sizes))}: k = 0 and k = 1")
    started = time.monotonic()
    try:
        batch = measure_batch_sizes(model, prompts, list(settings.batch_sizes),
                                    settings.max_tokens, settings.engine_args, settings.timeout,
                                    work / "batch", progress)
    except Exception as exc:  # noqa: BLE001 - as for the probe: reported, not raised
        checks.append(check("batch-sizes", False, engine_failure(exc, work / "batch"),
                            error=str(exc)[-4000:]))
        return None
    done = [r for r in batch["rows"] if r["modelled_speedup"] is not None]
    checks.append(check("batch-sizes", bool(done), "k = 1 over no speculation: " + ", ".join(
        f"batch {r['batch_size']} {r['modelled_speedup']:.2f}x" for r in done) if done else
        "no decode steps measured", **batch, seconds=time.monotonic() - started))
    return batch

