"""Bradley-Terry ratings on the Elo scale (coordinator/ratings.py) against their closed forms and the
model they fit."""

from __future__ import annotations

import json
import math
import random

import pytest

from polyrl_runtime.coordinator.ratings import (
    ANCHOR_RATING,
    RatingBook,
    bradley_terry,
    ratings_by_version,
    win_probability,
)


def test_two_nodes_have_the_closed_form_ratio_with_the_prior() -> None:
    # A beats the anchor 3 of 4, plus the prior's draw: 3.5 of 5, so strengths 3.5 : 1.5.
    r = bradley_terry([("a", "b", 3.0, 4.0)], anchor="b")
    assert r == pytest.approx(bradley_terry([("a", "b", 1.0, 1.0)] * 3 + [("b", "a", 1.0, 1.0)], anchor="b"))
    assert r["b"] == ANCHOR_RATING
    assert r["a"] - r["b"] == pytest.approx(400 * math.log10(3.5 / 1.5), abs=1e-6)


def test_draws_count_half_and_a_version_against_itself_is_ignored() -> None:
    r = bradley_terry([("a", "b", 5.0, 10.0), ("a", "a", 1.0, 1.0)], anchor="b")
    assert r["a"] == pytest.approx(ANCHOR_RATING, abs=1e-6)


def test_the_fit_recovers_the_ratings_that_generated_the_games() -> None:
    true = {0: 1000.0, 1: 1100.0, 2: 1250.0, 3: 1200.0}
    rng = random.Random(7)
    games = []
    for _ in range(6000):
        a, b = rng.sample(sorted(true), 2)
        games.append((a, b, float(rng.random() < win_probability(true[a], true[b])), 1.0))
    r = bradley_terry(games, anchor=0)
    for v, want in true.items():
        assert r[v] == pytest.approx(want, abs=25), (v, r)


def test_unbeaten_nodes_stay_finite_and_bad_scores_are_refused() -> None:
    r = bradley_terry([("a", "b", 5.0, 5.0)], anchor="b")
    assert math.isfinite(r["a"]) and r["a"] > ANCHOR_RATING
    with pytest.raises(ValueError, match=r"a score of 2.0 in 1.0 games is not in \[0, games\]"):
        bradley_terry([("a", "b", 2.0, 1.0)], anchor="b")


def test_a_policys_ratings_by_version() -> None:
    r = {("p", 2): 1010.0, ("q", 0): 990.0, ("p", 0): 1000.0}
    assert ratings_by_version(r, "p") == {0: 1000.0, 2: 1010.0}


def test_a_book_rates_each_group_of_policies_that_met_from_its_own_anchor() -> None:
    book = RatingBook(["solver", "judge", "player"])
    for _ in range(3):
        book.add(("player", 2), ("player", 0), 1.0)  # a league's games: the player's group alone
    book.add(("player", 2), ("player", 2), 1.0)  # a version against itself: no game
    book.add(("judge", 1), ("solver", 0), 0.0, games=2)  # a cross-play cell of two games
    ratings = book.ratings()
    # the player's group is anchored at its own version 0; the other at the solver's (first in order)
    assert ratings[("player", 0)] == ANCHOR_RATING and ratings[("solver", 0)] == ANCHOR_RATING
    assert ratings[("player", 2)] > ANCHOR_RATING > ratings[("judge", 1)]
    assert book.newest("player") == (2, ratings[("player", 2)]) and book.newest("nobody") is None
    assert book.progress("judge") == {"rating": round(ratings[("judge", 1)], 1), "rated_version": 1}


def test_a_named_anchor_fixes_its_group_at_the_given_rating() -> None:
    book = RatingBook(["me", "base"], anchor="base", anchor_rating=1500.0)
    book.add(("me", 4), ("base", 0), 3.0, games=4)
    book.add(("me", 0), ("base", 0), 1.0, games=4)
    ratings = book.ratings()
    assert ratings[("base", 0)] == 1500.0
    assert ratings[("me", 4)] > 1500.0 > ratings[("me", 0)]


def test_a_book_survives_a_checkpoint_as_json() -> None:
    book = RatingBook(["me", "base"], anchor="base")
    book.add(("me", 4), ("base", 0), 3.0, games=4)
    book.add(("me", 2), ("me", 0), 1.0)
    again = RatingBook(["me", "base"], anchor="base")
    again.restore(json.loads(json.dumps(book.state())))
    assert again.games == book.games and again.ratings() == book.ratings()
