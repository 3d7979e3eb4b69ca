"""The near-tie judge the soaks and the chaos bench use."""
from kvtier.bench.answer_check import Verdict, first_difference, judge
from kvtier.engine.sampling import TokenLogprob


def lp(token: int, top: list[tuple[int, float]]) -> TokenLogprob:
    return TokenLogprob(token, top[0][1], tuple(top))


REF = [lp(5, [(5, -0.1), (6, -2.0)]), lp(7, [(7, -3.4339731), (9, -3.4339736)]),
       lp(8, [(8, -0.5), (2, -0.6)])]


def test_equal_answers_are_the_same():
    assert judge([5, 7, 8], [5, 7, 8], REF) is Verdict.SAME
    assert first_difference([1], [1]) is None


def test_a_flip_between_the_reference_top_two_at_a_near_tie_is_a_near_tie():
    assert judge([5, 9, 4], [5, 7, 8], REF) is Verdict.NEAR_TIE  # what follows may differ


def test_a_difference_where_the_reference_is_sure_is_wrong():
    assert judge([6, 7, 8], [5, 7, 8], REF) is Verdict.WRONG  # gap 1.9 nats
    assert judge([5, 7, 2], [5, 7, 8], REF, tolerance=0.05) is Verdict.WRONG  # gap 0.1


def test_a_token_outside_the_top_two_is_wrong_even_at_a_tie():
    assert judge([5, 3], [5, 7], REF) is Verdict.WRONG


def test_lengths_and_missing_logprobs():
    assert first_difference([5, 7], [5, 7, 8]) == 2
    assert judge([5, 7], [5, 7, 8], REF) is Verdict.WRONG  # ended early: no token to judge
    assert judge([5, 9], [5, 7], None) is Verdict.WRONG
