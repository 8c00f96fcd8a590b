"""Issue 55: the hand-written sentences about the digits study say no more than the committed runs,
and the figures they quote are the ones the runs give (read here from the run records, so a rerun
that moves a number fails the test until the sentence is rewritten)."""

from __future__ import annotations

import math
import statistics
from functools import lru_cache
from pathlib import Path

import pytest
from digits_study import claims, digits, meanflow, samples
from scipy import stats as sps

#: sentences issue 55 quoted as saying more than the runs (or stale), which no page may carry again
STALE = (
    "the arms are equivalent within ±10 %",
    "are visible but inconclusive",
    "there but not significant beyond the smallest",
    "back at SiT's level (+0.2 % / −0.9 % vs SiT)",
    "RoPE on top of APE is the largest single improvement",
    "does not separate the backbones at any size (Welch p 0.11",
)  # the few-step study's quoted sentences: tests/test_nfe_study.py


def pages() -> list[Path]:
    """The README, every docs/ page and every results page (markdown)."""
    repo = digits.REPO
    return [repo / "README.md", *sorted((repo / "docs").rglob("*.md")),
            *sorted((repo / "results").rglob("*.md"))]


def text(path: Path) -> str:
    """A page with its line breaks and the typographic minus folded, so a sentence quoted across a
    wrapped line and a number with "−" match plain strings."""
    return " ".join(path.read_text().replace("−", "-").split())


@lru_cache(maxsize=1)
def results() -> tuple:
    return tuple(digits.load_results(digits.REPO / "results" / "digits"))


def test_no_page_repeats_a_sentence_issue_55_quoted():
    found = [(p.name, s) for p in pages() for s in STALE
             if " ".join(s.replace("−", "-").split()) in text(p)]
    assert not found, found


def _points(row: dict) -> str:
    lo, hi = row["ci"]
    return f"{row['effect']:+.2f} points [{lo:+.1f}, {hi:+.1f}]"


def test_family_t_is_in_the_plain_words_and_the_bottom_lines_with_the_runs_figures():
    """SiT's classification win and ViT-5's pixel recall on digits16 (family T), as the runs give
    them, in claims_summary.md, CLAIMS.md's plain words, the main README's C9 sentence and both
    generated bottom lines."""
    rows = {r["test"].name: r for r in samples.evaluate_samples(list(results()))
            if r["test"].family == "T"}
    accuracy, recall = rows["class accuracy (digits16)"], rows["pixel recall (digits16)"]
    assert accuracy["verdict"] == "SiT better" and recall["verdict"] == "ViT-5 better"
    summary = [digits.REPO / "results" / "digits" / name for name in ("claims_summary.md",
                                                                      "CLAIMS.md")]
    for page in summary:
        body = text(page)
        for row in (accuracy, recall):
            assert _points(row) in body, (page.name, _points(row))
            assert f"Holm {samples._p(row['p_holm'])}" in body, (page.name, row["p_holm"])
        assert "family T" in body
    readme = text(digits.REPO / "docs" / "comparison.md")
    assert f"{accuracy['effect']:+.2f} points, Holm {samples._p(accuracy['p_holm'])}" in readme
    line = " ".join(samples.bottom_line(list(results())).replace("−", "-").split())
    for page in (digits.REPO / "docs" / "comparison.md",
                 digits.REPO / "results" / "digits" / "README.md"):
        assert line in text(page), page  # the generated block is the committed one
    assert "family T" in line and "SiT is better in class accuracy" in line


def _loss_row(dataset: str, name: str) -> dict:
    return next(r for r in claims.evaluate_family(list(results()))
                if r["test"].dataset == dataset and r["test"].name == name)


def test_the_size_resolution_and_fid16_figures_are_the_runs():
    """C1's 8×128 digits8 effect, C5's interpolated-table row at 6×6, and FID16's Welch p at every
    size (S16 at 4×64; raw FID16 of the n = 3 size runs) as the prose quotes them."""
    c1 = _loss_row("digits8", "ViT-5 vs SiT at 8×128")
    lo, hi = c1["ci"]
    quoted = f"{c1['effect']:+.2f} % [{lo:+.1f}, {hi:+.1f}]"
    assert quoted == "-0.28 % [-0.8, +0.2]" and lo < 0 < hi  # no lead shown
    assert quoted in text(digits.REPO / "docs" / "comparison.md")
    assert quoted in text(digits.REPO / "results" / "digits" / "claims_summary.md")
    six = claims.resolution_references(list(results()))[0]
    assert six["size"] == "6×6" and six["vs SiT interpolated"].startswith("+6.4 [+0.5, +12.2], p=0.041")
    assert "+6.4 log-% [+0.5, +12.2], raw p 0.041" in text(digits.REPO / "docs" / "comparison.md")
    s16 = next(r for r in samples.evaluate_samples(list(results())) if r["test"].name.startswith("S16"))
    ps = [samples._p(s16["p"])]
    for size in ("6×96", "8×128"):
        fid = [[r["checkpoints"][str(r["steps"])]["digits_fid16"] for r in results()
                if r["dataset"] == "digits16" and r["variant"] == f"{arm} {size}"]
               for arm in ("ViT-5 (γ0=1)", "SiT")]
        ps.append(f"{sps.ttest_ind(*fid, equal_var=False).pvalue:.2g}")
    assert ps == ["0.7", "0.22", "0.52"]
    assert ("FID16 does not separate the backbones at any size (Welch p 0.70 at 4×64 with n = 36 per "
            "arm, row C9; 0.22 and 0.52 at 6×96 and 8×128 with n = 3)") in text(
        digits.REPO / "results" / "digits" / "claims_summary.md")


def test_the_rope_ablation_sentence_quotes_the_n4_runs():
    """ViT-5 − RoPE against SiT at n = 4 (+1.22 %, p 0.0037 on digits8) and against ViT-5 (Holm
    0.00058 on digits8, 0.18 on digits16), in analysis.md and the digits README."""
    against_sit = {}
    for d in ("digits8", "digits16"):
        runs, sit = digits._by(list(results()), d, "ViT-5 − RoPE"), digits._by(list(results()), d, "SiT")
        assert len(runs) == 4
        loss, ref = digits._final(runs, "heldout_loss"), digits._final(sit, "heldout_loss")
        rel = 100 * (statistics.fmean(loss) - statistics.fmean(ref)) / statistics.fmean(ref)
        against_sit[d] = (f"{rel:+.2f} %", f"{sps.ttest_ind(loss, ref, equal_var=False).pvalue:.2g}")
    assert against_sit == {"digits8": ("+1.22 %", "0.0037"), "digits16": ("-0.65 %", "0.29")}
    holm = {d: claims._p(_loss_row(d, "ViT-5 − RoPE vs ViT-5 (γ0=1)")["p_holm"])
            for d in ("digits8", "digits16")}
    assert holm == {"digits8": "0.00058", "digits16": "0.18"}
    for page in ("analysis.md", "README.md"):
        body = text(digits.REPO / "results" / "digits" / page)
        assert "+1.22 % vs SiT (Welch p 0.0037)" in body and "-0.65 % (p 0.29)" in body, page
        assert "Holm 0.00058" in body and "(Holm 0.18)" in body, page


@pytest.mark.parametrize("value", [0.0037, 2.9e-06])
def test_the_p_format_the_prose_copies_is_two_significant_digits(value):
    assert samples._p(value) == f"{value:.2g}" and not math.isnan(value)


def _git(*args: str):
    import subprocess

    return subprocess.run(["git", *args], cwd=digits.REPO, capture_output=True, text=True)


def test_a_run_record_that_carries_a_commit_descends_from_every_protocol_addition_before_it():
    """Records written since issue 55 carry ``started_utc`` and ``commit``: each protocol addition
    committed before a run started is an ancestor of the commit the run ran from (so the run was
    judged by rules its code already had). Older records carry neither and are not checked."""
    import datetime
    import json
    import re

    protocol = digits.REPO / "results" / "digits" / "PROTOCOL.md"
    headings = re.findall(r"^## Addition \([^)]*\)", protocol.read_text(), flags=re.M)
    assert len(headings) >= 7
    added = []
    for heading in headings:
        log = _git("log", "--reverse", "--format=%H %cI", "-S", heading, "--", str(protocol))
        if log.returncode or not log.stdout.strip():
            pytest.skip("no git history of PROTOCOL.md here")
        commit, when = log.stdout.split("\n")[0].split()
        added.append((heading, commit, datetime.datetime.fromisoformat(when)))
    first = added[0][1]  # the primitive tells the order apart (so the loop below can fail)
    assert _git("merge-base", "--is-ancestor", first, "HEAD").returncode == 0
    assert _git("merge-base", "--is-ancestor", "HEAD", first).returncode == 1
    records = [json.loads(p.read_text()) for p in
               sorted((digits.REPO / "results" / "digits" / "runs").rglob("*.json"))]
    for record in (r for r in records if r.get("commit")):
        started = datetime.datetime.fromisoformat(record["started_utc"].replace("Z", "+00:00"))
        commit = record["commit"].removesuffix("-dirty")
        for heading, addition, when in added:
            if when <= started:
                assert _git("merge-base", "--is-ancestor", addition, commit).returncode == 0, (
                    record["dataset"], record["variant"], record["seed"], heading)


def test_the_readme_says_which_backbone_wins_at_1_nfe_as_the_runs_give_it():
    """Issue 53: the README states C10's registered answer, and says "not answered yet" while a group is pending."""
    n = meanflow.planned_n(meanflow.read_pilot(digits.REPO / "results" / "digits"))
    assert None not in n.values(), "meanflow_pilot.json is committed with both datasets' n"
    rows = meanflow.evaluate_meanflow(list(results()), n)
    assert [r["test"].family for r in rows].count("M") == 2
    verdict = meanflow.answer(rows)
    stated = "Which backbone wins at 1 NFE, as MeanFlow models on the digits proxy (pre-registered, row C10 of"
    readme = text(digits.REPO / "README.md")
    assert stated in readme
    said = readme.split(stated, 1)[1].split("):", 1)[1].strip()
    expected = "not answered yet" if verdict.startswith("not answered yet") else verdict
    assert said.startswith(expected), (said[:120], verdict)
    if expected == verdict:  # answered: the sentence quotes each primary test's geometric means and Holm p
        sentence = " ".join(said.split("```", 1)[0].split())
        for row in (r for r in rows if r["test"].family == "M"):
            vit, sit = (f"{math.exp(m):.1f}" for m in row["mean"])
            assert f"{vit} against {sit}" in sentence or f"{vit} against SiT's {sit}" in sentence, (vit, sit)
            holm = f"Holm p {samples._p(row['p_holm'])}"  # as CLAIMS.md's table writes it
            assert f"n = {row['planned']}" in sentence and holm in sentence, row["test"].name
