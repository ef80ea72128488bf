"""The order of a sweep's engine processes: what a cell compares runs close together in time."""

import pytest

from vllm_mtp_plugin.tools.bench.cli import parse_args
from vllm_mtp_plugin.tools.bench.offline_mode import process_order
from vllm_mtp_plugin.tools.bench.sweep import Sweep


def labels(order):
    return [(round_, c.impl, c.k, c.concurrency) for round_, c in order]


def test_cell_order_runs_a_cells_rounds_together_every_other_one_reversed():
    sweep = Sweep(impls=["plugin", "adaptive"], ks=[0, 3], concurrencies=[1, 4], processes=3,
                  adaptive_ks=[3])
    order = labels(process_order(sweep.configs(), sweep.processes, "cell"))
    cell = [("plugin", 0), ("plugin", 3), ("adaptive", 3)]
    expected = [(r, impl, k, c) for c in (1, 4) for r in range(3)
                for impl, k in (cell if r % 2 == 0 else cell[::-1])]
    assert order == expected
    assert len(order) == 3 * 3 * 2  # every configuration, every round, once


def test_grid_order_goes_round_by_round_over_the_whole_grid():
    sweep = Sweep(impls=["plugin"], ks=[0, 1], concurrencies=[1, 4], processes=2)
    order = labels(process_order(sweep.configs(), sweep.processes, "grid"))
    assert order == [(r, "plugin", k, c) for r in range(2) for k in (0, 1) for c in (1, 4)]


def test_the_floor_configurations_are_cells_of_their_own():
    sweep = Sweep(impls=["plugin"], ks=[0, 1], concurrencies=[1], processes=2, floor=True)
    order = labels(process_order(sweep.configs(), sweep.processes, "cell"))
    # k = 0 and k = 1 at c = 1 alternate; the floor (k = 0 with 2 rows) follows on its own
    assert order == [(0, "plugin", 0, 1), (0, "plugin", 1, 1), (1, "plugin", 1, 1),
                     (1, "plugin", 0, 1), (0, "plugin", 0, 2), (1, "plugin", 0, 2)]


def test_the_command_defaults_to_cell_order_and_refuses_an_unknown_one(capsys):
    assert parse_args(["offline"]).order == "cell"
    assert parse_args(["offline", "--order", "grid"]).order == "grid"
    with pytest.raises(SystemExit):
        parse_args(["offline", "--order", "random"])
    assert "invalid choice: 'random'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown order 'random'"):
        Sweep(order="random")
