"""bench.session_hits' reading of a round: the oracle of each follow-up, and whether the
turns sent away from their cache were slower than those that found it."""

from __future__ import annotations

from bench.session_hits import Turn, oracle_tokens, sent_away, summarize


def test_the_oracle_is_the_previous_prompts_full_blocks_the_engine_may_reuse() -> None:
    assert oracle_tokens(None, 100, 16) == 0  # a first turn
    assert oracle_tokens(70, 120, 16) == 64  # the previous prompt's 4 full blocks
    assert oracle_tokens(70, 65, 16) == 64  # all but the prompt's last token
    assert oracle_tokens(70, 64, 16) == 48


def _round(away_ttft_s: float) -> list[list[Turn]]:
    """Three sessions of two turns; the third's follow-up found nothing of its history."""
    first = Turn(60, 0, 0, 0.5)
    return [
        [first, Turn(100, 48, 48, 0.20)],
        [first, Turn(100, 48, 48, 0.30)],
        [first, Turn(100, 0, 48, away_ttft_s)],
    ]


def test_a_turn_sent_away_is_set_beside_the_same_turns_at_home() -> None:
    (away,) = sent_away(_round(0.22))
    assert away == {"turn": 2, "ttft_s": 0.22, "home_ttft_p50_s": 0.25}


def test_a_round_below_the_oracle_passes_only_if_no_turn_sent_away_was_slower() -> None:
    faster, slower = summarize(1, 0, _round(0.22)), summarize(1, 0, _round(0.40))
    assert faster["hit_ratio"] == slower["hit_ratio"] == 96 / 144
    assert faster["turns_below_oracle"] == 1
    assert faster["away_no_slower"] and not slower["away_no_slower"]
    # With nothing at home to compare with, a turn sent away proves nothing.
    alone = [[Turn(60, 0, 0, 0.5), Turn(100, 0, 48, 0.1)]]
    assert not summarize(1, 0, alone)["away_no_slower"]
    # Every follow-up at home: nothing to excuse.
    assert summarize(1, 0, _round(0.22)[:2])["away_no_slower"]
