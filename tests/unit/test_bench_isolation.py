"""bench/isolation.py's pure parts: ratios to the alone phase, medians over trials, the
quota overshoot against one request, and the report's tables and verdicts."""

from __future__ import annotations

import math
import sys
from collections import Counter
from pathlib import Path

from pytest import approx

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # the bench scripts import each other as top-level modules

import isolation as iso  # noqa: E402


def phase(
    case: str, trial: int, ttfts: list[float | None], tokens: int, elapsed: float
) -> iso.Phase:
    """A phase of len(ttfts) victim requests over ``elapsed`` s: those with a TTFT answered
    (sharing ``tokens`` evenly), those with None refused."""
    per = tokens // sum(t is not None for t in ttfts)
    asks = [
        iso.Ask(t, per, "200") if t is not None else iso.Ask(None, 0, "429 queue_full")
        for t in ttfts
    ]
    return iso.Phase(case, trial, asks, elapsed)


def test_a_phase_counts_tokens_per_second_and_a_failed_request_as_an_infinite_ttft() -> None:
    p = phase("heavy", 1, [0.1, 0.2, None, 0.3], 30, 2.0)
    assert p.tokens == 30 and p.tokens_per_s == 15.0
    assert p.failed == 1
    assert p.p99_ttft_s == math.inf  # nearest rank: the worst of 4
    assert p.p50_ttft_s == 0.25
    ok = phase("alone", 1, [0.1, 0.2, 0.4, 0.3], 40, 2.0)
    assert ok.p99_ttft_s == 0.4 and ok.failed == 0


def test_ratio_is_nan_without_a_denominator_and_inf_for_a_starved_victim() -> None:
    assert iso.ratio(3.0, 2.0) == 1.5
    assert math.isnan(iso.ratio(1.0, 0.0))
    assert math.isnan(iso.ratio(math.nan, 1.0))
    assert math.isnan(iso.ratio(1.0, math.inf))
    assert iso.ratio(math.inf, 0.5) == math.inf


def test_median_skips_nan_and_keeps_inf() -> None:
    assert iso.med([3.0, math.nan, 1.0, 2.0]) == 2.0
    assert iso.med([1.0, math.inf, math.inf]) == math.inf
    assert math.isnan(iso.med([math.nan]))


def test_each_case_is_divided_by_the_alone_phase_just_before_it() -> None:
    phases = [
        phase("alone", 1, [0.1, 0.1], 100, 1.0),  # 100 tok/s, p99 0.1
        phase("heavy", 1, [0.3, 0.3], 50, 1.0),  # 0.5x, 3x
        phase("alone", 1, [0.2, 0.2], 200, 1.0),  # 200 tok/s, p99 0.2
        phase("grammar", 1, [0.2, 0.2], 180, 1.0),  # 0.9x, 1x
        phase("alone", 2, [0.1, 0.1], 100, 1.0),
        phase("heavy", 2, [0.1, 0.1], 90, 1.0),  # 0.9x, 1x
        phase("alone", 3, [0.1, 0.1], 100, 1.0),
        phase("heavy", 3, [0.2, 0.2], 80, 1.0),  # 0.8x, 2x
    ]
    got = {c.case: c for c in iso.case_results(phases)}
    assert set(got) == {"heavy", "grammar"}
    assert got["heavy"].toks_ratios == approx((0.5, 0.9, 0.8))
    assert got["heavy"].ttft_ratios == approx((3.0, 1.0, 2.0))
    assert (got["heavy"].toks, got["heavy"].ttft) == approx((0.8, 2.0))  # medians over trials
    assert (got["grammar"].toks, got["grammar"].ttft) == approx((0.9, 1.0))
    # A case is never divided by an alone phase of another trial.
    assert iso.pairs([phase("alone", 1, [0.1], 1, 1.0), phase("heavy", 2, [0.1], 1, 1.0)]) == []


def test_overshoot_is_what_was_charged_beyond_the_limit_against_one_request() -> None:
    o = iso.Overshoot(limit=100, charged=130, requests=4, prompt_tokens=42, max_tokens=16)
    assert o.over == 30
    assert o.one_request == 11 + 16  # the mean prompt, rounded up, + max_tokens
    assert not o.ok
    assert iso.Overshoot(100, 120, 4, 40, 16).ok  # 20 over, one request 26
    assert iso.Overshoot(100, 90, 3, 30, 16).over == 0
    assert iso.Overshoot(100, 0, 0, 0, 16).one_request == 16


def test_verdicts_name_each_target_met_or_missed() -> None:
    phases = [
        phase("alone", 1, [0.1, 0.1], 100, 1.0),
        phase("heavy", 1, [0.15, 0.15], 80, 1.0),  # 0.8x, 1.5x: both met
        phase("alone", 1, [0.1, 0.1], 100, 1.0),
        phase("quota", 1, [0.1, None], 50, 1.0),  # 0.5x, inf: both missed
    ]
    phases[-1].overshoot = iso.Overshoot(100, 160, 6, 60, 16)
    lines = iso.verdicts(iso.case_results(phases))
    heavy = next(line for line in lines if line.startswith("- heavy"))
    assert "0.80x alone (target ≥ 0.7x: met)" in heavy
    assert "1.50x alone (target ≤ 2x: met)" in heavy
    quota = [line for line in lines if line.startswith("- quota")]
    assert "0.50x alone (target ≥ 0.7x: MISSED)" in quota[0]
    assert "infx alone (target ≤ 2x: MISSED)" in quota[0]
    assert "overshoot 60 tokens" in quota[1] and "MISSED" in quota[1]
    assert iso.met(math.nan, 0.7, True) == "MISSED (not measured)"


def test_a_cases_overshoot_is_one_line_its_worst_trial() -> None:
    phases = []
    for trial, charged in ((1, 110), (2, 160), (3, 105)):
        phases += [phase("alone", trial, [0.1], 100, 1.0), phase("quota", trial, [0.1], 90, 1.0)]
        phases[-1].overshoot = iso.Overshoot(100, charged, 6, 60, 16)
    lines = [ln for ln in iso.verdicts(iso.case_results(phases)) if "overshoot" in ln]
    assert len(lines) == 1
    assert "overshoot 60 tokens at worst" in lines[0] and "worst of 3 trial(s)" in lines[0]
    assert "MISSED" in lines[0]  # one trial past one request is a miss


def test_the_report_tables_have_a_row_per_phase_and_the_other_users_outcomes() -> None:
    alone = phase("alone", 1, [0.1, 0.1], 100, 1.0)
    grammar = phase("grammar", 1, [0.2, None], 40, 1.0)
    grammar.other = Counter({"400 invalid_schema": 3, "200": 1})
    grammar.notes.append("the model was not drained")
    report = iso.Report("setup text", [alone, grammar])
    table = iso.rows(report.phases)
    assert [r[1] for r in table] == ["alone", "grammar"]
    assert table[0][9] == "-"  # alone has no ratio
    assert table[1][8] == "inf" and table[1][9] == "0.40"
    assert table[1][-1] == "400 invalid_schema x3, 200 x1"
    text = report.text()
    assert text.startswith("setup text") and "targets:" in text
    assert "- trial 1 grammar: the model was not drained" in text
    md = report.markdown()
    assert "| trial | case | victim n |" in md
    assert md.count("\n| 1 |") == 2
    assert iso.outcomes(Counter()) == "-"
