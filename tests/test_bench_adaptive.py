"""The pure pieces of ``python -m experiments.bench adaptive`` (no testbed, no training)."""

import pytest

from experiments.bench import adaptive as B
from jaxcomm.tools.testbed import parse_rate

DROP = {"t": 10.0, "link": "100mbit", "bps": 100e6, "from_bps": 1e9}
RISE = {"t": 30.0, "link": "1gbit", "bps": 1e9, "from_bps": 100e6}


def _windows(levels, width=2.0):
    """Windows of ``width`` seconds: window k ends at (k + 1) * width."""
    return [{"t_end": (k + 1) * width, "level": lv} for k, lv in enumerate(levels)]


def test_link_changes_are_the_records_after_the_first_relative_to_t0():
    log = [
        {"time": 100.0, "link": "1gbit", "link_bps": 1e9},
        {"time": 150.5, "link": "100mbit", "link_bps": 1e8},
        {"time": 170.0, "link": "1gbit", "link_bps": 1e9},
    ]
    got = B.link_changes(log, t0=140.0)
    assert got == [
        {"t": 10.5, "link": "100mbit", "bps": 1e8, "from_bps": 1e9},
        {"t": 30.0, "link": "1gbit", "bps": 1e9, "from_bps": 1e8},
    ]


def test_reaction_delay_counts_windows_from_the_one_the_link_changed_in():
    # The drop at 10 s falls in window 5 (10-12 s; window 4 ends at 10, not after it); up at
    # window 6 (delay 1) and 7. The rise at 30 s falls in window 15; down at 17 (delay 2).
    levels = [0] * 6 + [1, 2] + [2] * 9 + [1, 0] + [0] * 3
    d = B.reaction_delays(_windows(levels), [DROP, RISE])
    assert [(x["direction"], x["delay_windows"]) for x in d] == [("up", 1), ("down", 2)]
    assert d[0]["delay_s"] == pytest.approx(12.0 - 10.0)  # the window before the move ends
    assert d[1]["delay_s"] == pytest.approx(34.0 - 30.0)
    assert B.oscillations(_windows(levels), [DROP, RISE]) == [0, 0, 0]


def test_a_move_the_wrong_way_is_no_reaction_and_counts_as_oscillation():
    # After the drop the level goes down, then up, then down again; it never reacts to the
    # rise (the moves after 30 s are up).
    levels = [1] * 6 + [0, 1, 2, 1] + [1] * 7 + [2, 2, 2]
    w = _windows(levels)
    d = B.reaction_delays(w, [DROP, RISE])
    assert d[0]["delay_windows"] == 2  # window 7 is the first up move
    assert d[1]["delay_windows"] is None and d[1]["delay_s"] is None
    assert B.oscillations(w, [DROP, RISE]) == [0, 2, 1]


def test_oscillation_before_any_change_counts_reversals():
    w = _windows([0, 1, 0, 1, 1, 2])
    assert B.oscillations(w, []) == [2]
    assert B.reaction_delays(w, []) == []


def test_a_change_after_the_last_window_has_no_delay():
    late = dict(DROP, t=99.0)
    assert B.reaction_delays(_windows([0, 1]), [late])[0]["delay_windows"] is None


def _run(seconds, acc, **kw):
    return {"seconds": seconds, "accuracy": acc, "t": [], "step_time": [],
            "link_changes": [DROP, RISE], **kw}  # fmt: skip


def test_summary_compares_with_the_fixed_levels_that_keep_quality():
    w = _windows([0] * 6 + [1, 2] + [2] * 9 + [1, 0])
    runs = {
        "adaptive": _run(100.0, 0.970, windows=w),
        "f32": _run(150.0, 0.972),
        "int8": _run(110.0, 0.968),  # within 0.5 points of f32
        "int4": _run(90.0, 0.960),  # faster, but 1.2 points worse: not a competitor
    }
    s = B.summarize(runs)
    assert s["quality_ok"] == ["f32", "int8"]
    assert s["adaptive_quality_ok"] and s["faster_than_all_ok"]
    runs["int8"]["seconds"] = 95.0
    assert not B.summarize(runs)["faster_than_all_ok"]
    runs["adaptive"]["accuracy"] = 0.960
    assert not B.summarize(runs)["adaptive_quality_ok"]


def test_parse_runs_names_the_choices():
    assert B.parse_runs("adaptive, f32,int8") == ["adaptive", "f32", "int8"]
    for bad in ("adaptive,int2", "", "f32,f32", "topk:0.1"):
        with pytest.raises(ValueError, match="adaptive"):
            B.parse_runs(bad)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--runs", "adaptive,fp8"], "--runs"),
        (["--ladder", "f32,topk:0.1"], "--ladder"),
        (["--schedule", "40s-100mbit"], "TIME:RATE"),
        (["--link", "fast"], "link rate"),
        (["--batch", "30"], "--batch 30 must divide"),
        (["--comm-low", "0.5", "--comm-high", "0.3"], "comm_high"),
        (["--window", "0"], "adjustment_step"),
        (["--hidden", "0"], "--hidden"),
    ],
)
def test_bad_arguments_fail_before_any_testbed(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        B.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_defaults_parse_and_the_worker_gets_every_setting():
    args = B.parse_args([])
    assert args.runs == ["adaptive", *B.FIXED] and set(args.ladder) <= set(B.FIXED)
    rates = [parse_rate(r) for _, r in args.schedule]
    assert rates[0] < parse_rate(args.link) == rates[-1]  # a drop, then the link restored
    again = B.parse_args(["--worker", "int8", *B._forward(args)])
    for k in ("steps", "hidden", "batch", "seed", "ladder", "window", "comm_low", "comm_high",
              "cooldown", "error_low", "error_high", "start_at"):  # fmt: skip
        assert getattr(again, k) == getattr(args, k), k
