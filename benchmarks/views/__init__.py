"""The generated parts of the docs, by the name a doc's ``<!-- results: NAME -->`` marker uses."""

from __future__ import annotations

from functools import partial

from . import acceptance, adaptive, doctor, live, model, runs, speed, training, tune
from .common import View

TRAINED = (acceptance.TRAINED,)
TUNE = tuple(f"benchmarks/results/tune-{name}/{f}" for name in tune.MODELS
             for f in ("check.json", "tune.json"))

VIEWS: dict[str, View] = {
    "adaptive-shift": View(adaptive.shift_table, (adaptive.SHIFT,)),
    "adaptive-steady": View(adaptive.steady_table, (adaptive.STEADY,)),
    "adaptive-steady-rerun": View(partial(adaptive.steady_table, adaptive.STEADY_RERUN),
                                  (adaptive.STEADY_RERUN,)),
    "adaptive-steady-grid": View(partial(adaptive.steady_table, adaptive.STEADY_GRID),
                                 (adaptive.STEADY_GRID,)),
    "adaptive-steady-grid-met": View(adaptive.steady_targets_met, (adaptive.STEADY_GRID,)),
    "adaptive-steady-warm": View(partial(adaptive.steady_table, adaptive.STEADY_WARM),
                                 (adaptive.STEADY_WARM,)),
    "adaptive-steady-warm-met": View(partial(adaptive.steady_targets_met, adaptive.STEADY_WARM),
                                     (adaptive.STEADY_WARM,)),
    "adaptive-steady-warm-choices": View(adaptive.adaptive_choices_table, (adaptive.STEADY_WARM,)),
    "adaptive-steady-cell": View(partial(adaptive.steady_table, adaptive.STEADY_CELL),
                                 (adaptive.STEADY_CELL,)),
    "adaptive-steady-cell-paired": View(adaptive.steady_paired_table, (adaptive.STEADY_CELL,)),
    "adaptive-steady-cell-paired-met": View(adaptive.steady_paired_met, (adaptive.STEADY_CELL,)),
    "adaptive-steady-cell-met": View(partial(adaptive.steady_targets_met, adaptive.STEADY_CELL),
                                     (adaptive.STEADY_CELL,)),
    "adaptive-steady-cell-choices": View(partial(adaptive.adaptive_choices_table,
                                                 adaptive.STEADY_CELL), (adaptive.STEADY_CELL,)),
    "adaptive-shift-ratio": View(adaptive.shift_ratio, (adaptive.SHIFT,)),
    "adaptive-shift-rerun-ratio": View(partial(adaptive.shift_ratio, True),
                                       (adaptive.SHIFT, adaptive.RERUN)),
    "doctor-selftest": View(doctor.selftest_table, (doctor.SELFTEST,)),
    "doctor-selftest-minutes": View(doctor.selftest_minutes, (doctor.SELFTEST,)),
    "doctor-trained": View(doctor.trained_report, (doctor.TRAINED,)),
    "doctor-trained-batch-sizes": View(doctor.trained_batch_sizes, (doctor.TRAINED,)),
    "live-record-cost": View(live.record_cost, (live.COST,)),
    "live-record-cost-ratio": View(live.record_cost_ratio, (live.COST,)),
    "live-record-cost-interval": View(live.record_cost_interval, (live.COST,)),
    "live-record-window-share": View(live.record_window_share, (live.COST,)),
    "live-record-choice": View(live.record_choice, (live.CHOICE,)),
    "live-adapt-events": View(live.adapt_events, (live.ADAPT,)),
    "live-adapt-summary": View(live.adapt_summary, (live.ADAPT,)),
    "live-adapt-ratio": View(live.adapt_ratio, (live.ADAPT,)),
    "live-adapt-minutes": View(live.adapt_minutes, (live.ADAPT,)),
    "trained-quality": View(model.quality_table, (model.RECORD,)),
    "trained-quality-sentence": View(model.quality_sentence, (model.RECORD,)),
    "trained-parameters": View(model.parameters, (model.RECORD,)),
    "trained-training-time": View(model.training_time, (model.RECORD,)),
    "trained-size": View(model.size, (model.RECORD,)),
    **{f"trained-corpus-{kind}": View(partial(model.corpus_characters, kind), (model.RECORD,))
       for kind in ("prose", "code")},
    "trained-tokens-seen": View(model.tokens_seen, (model.RECORD,)),
    "trained-v4-quality": View(partial(model.quality_table, model.RECORD_V4), (model.RECORD_V4,)),
    "trained-v4-size": View(partial(model.size, model.RECORD_V4), (model.RECORD_V4,)),
    "trained-v4-acceptance": View(partial(acceptance.trained_acceptance, acceptance.TRAINED_V4),
                                  (acceptance.TRAINED_V4,)),
    "trained-metrics-exact": View(model.metrics_exact, (model.RECORD,)),
    "trained-acceptance": View(acceptance.trained_acceptance, TRAINED),
    "trained-acceptance-intervals": View(acceptance.trained_intervals, TRAINED),
    "trained-first-position-t0": View(partial(acceptance.first_position_range, 0.0), TRAINED),
    "trained-first-position-t1": View(partial(acceptance.first_position_range, 1.0), TRAINED),
    "trained-first-position-t1-probabilistic": View(
        partial(acceptance.first_position_range, 1.0, "probabilistic"), TRAINED),
    "trained-sampling": View(acceptance.trained_sampling, TRAINED),
    "trained-kinds-compared": View(acceptance.kinds_compared, TRAINED),
    "trained-sampling-separation": View(acceptance.sampling_separation, TRAINED),
    **{f"trained-k3-{kind}": View(partial(acceptance.k3_positions, kind), TRAINED)
       for kind in acceptance.KINDS},
    "no-plugin": View(acceptance.no_plugin_table, (acceptance.NO_PLUGIN,)),
    "v4tiny-acceptance": View(acceptance.v4tiny_acceptance, (acceptance.V4TINY,)),
    "trained-speed": View(speed.trained_speed, TRAINED),
    **{f"{name}-k3-c1-{part}": View(partial(render, checkpoint, 3), tuple(runs.files()))
       for name, checkpoint in (("bench", "bench-noisy-0.8"), ("trained", "trained"))
       for part, render in (("speedups", runs.speedups), ("runs", runs.runs_table))},
    "bench-parameters": View(partial(runs.parameters, "bench-noisy-0.8"), tuple(runs.files())),
    "bench-drafter": View(partial(runs.drafter, "bench-noisy-0.8"), (speed.FULL["offline"],)),
    **{f"verify-{name}": View(partial(speed.verify_table, name), (path,))
       for name, path in speed.VERIFY.items()},
    **{f"verify-{name}-changes": View(partial(speed.verify_changes, name), (path,))
       for name, path in speed.VERIFY.items() if name != "avx2"},
    "verify-bench-k0-passes": View(partial(speed.k0_passes, "bench"), (speed.VERIFY["bench"],)),
    "verify-payoff-example": View(speed.payoff_example, tuple(speed.VERIFY.values())),
    **{f"bench-{name}": View(partial(speed.full_table, name), (path,))
       for name, path in speed.FULL.items()},
    **{f"bench-{name}-settings": View(partial(speed.run_settings, name), (path,))
       for name, path in speed.FULL.items()},
    "bench-offline-draft-memory": View(partial(speed.draft_memory, "offline"),
                                       (speed.FULL["offline"],)),
    "bench-offline-draft-memory-difference": View(partial(speed.draft_memory, "offline", True),
                                                  (speed.FULL["offline"],)),
    "bench-sizes-speedups": View(speed.sizes_speedups, (speed.FULL["sizes"],)),
    "bench-offline-draft-cost": View(partial(speed.draft_cost, "offline"),
                                     (speed.FULL["offline"],)),
    "bench-offline-measured-over-ideal": View(partial(speed.measured_over_ideal, "offline"),
                                              (speed.FULL["offline"],)),
    **{f"tune-{name}-fixed-k3-cost": View(partial(tune.fixed_k_cost, name, 3), TUNE)
       for name in tune.MODELS},
    "tune-bench-config": View(partial(tune.printed_config, "bench"), TUNE),
    "tune-bench-sweep-command": View(partial(tune.sweep_command, "bench"), TUNE),
    "tune-sweeps-interference": View(tune.sweeps_interference, TUNE),
    "tune-bench-c1-k0-processes": View(partial(tune.k0_processes, "bench", 1), TUNE),
    "tune-sampled": View(tune.sampled_methods, (tune.SAMPLED,)),
    "tune": View(partial(tune.tune_table, False), TUNE),
    "tune-ranges": View(partial(tune.tune_table, True), TUNE),
    **{f"training-{proof}": View(partial(training.proof_table, proof), (training.file(proof),))
       for proof in training.LAYERS},
    "training-v4-ratio": View(partial(training.ratio, "v4", "trained_from_scratch",
                                      "jointly_trained"), (training.file("v4"),)),
    "training-v4-vs-joint": View(partial(
        training.compare, "v4", "trained_from_scratch", "jointly_trained", 1, 0),
        (training.file("v4"),)),
    "training-graft-vs-joint": View(partial(
        training.compare, "graft", "trained_from_scratch", "jointly_trained", 1, 0),
        (training.file("graft"),)),
    "training-recursive-position-3": View(partial(
        training.compare, "recursive", "depth3_recursive", "depth1", 3, 2),
        (training.file("recursive"),)),
    "training-loss": View(training.loss_table, (training.file("loss"),)),
    **{f"training-loss-{serving.replace('_', '-')}": View(
        partial(training.loss_compare, serving), (training.file("loss"),))
       for serving, _, _ in training.LOSS_SERVINGS},
    "training-default-run": View(training.default_run, (training.file("graft"),)),
    "training-graft-seconds": View(partial(training.seconds, "graft"), (training.file("graft"),)),
    "training-foreign-seconds": View(partial(training.seconds, "foreign"),
                                     (training.file("foreign"),)),
    "training-foreign-vs-graft": View(training.foreign_vs_graft,
                                      (training.file("foreign"), training.file("graft"))),
    "training-refresh-perplexity": View(training.refresh_perplexity, (training.file("refresh"),)),
    "training-refresh-training": View(training.refresh_training, (training.file("refresh"),)),
    "training-refresh-vs-old": View(partial(
        training.compare, "refresh", "fine_tuned_refreshed_on_cpp", "fine_tuned_old_layer_on_cpp",
        1, 0), (training.file("refresh"),)),
}
