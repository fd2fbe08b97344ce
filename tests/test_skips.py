"""`skips.SkipWatch`: a run where most steps changed no weight warns once, with the reason
and what to change; a run where half or fewer skipped says nothing."""

import warnings

import pytest

from longstraw.skips import TRAIN_ADVICE, NoUpdateWarning, SkipWatch, loss_note, no_update_reason

EQUAL = "no update (equal rewards)"


def _run(reasons, total=None, rewards=None):
    watch = SkipWatch("longstraw train", TRAIN_ADVICE, total=total)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for k, reason in enumerate(reasons):
            watch.step(reason, reward_mean=None if rewards is None else rewards[k])
        watch.finish()
    return [w for w in seen if issubclass(w.category, NoUpdateWarning)]


def test_most_steps_skipping_warns_once_with_the_reason_and_what_to_change():
    seen = _run([EQUAL, None, EQUAL, EQUAL, EQUAL, EQUAL, EQUAL, EQUAL], rewards=[0.0] * 8)
    assert len(seen) == 1  # once, however many steps skip after the verdict
    text = str(seen[0].message)
    assert "3 of 4 steps so far changed no weight" in text  # judged at the fourth step
    assert "every advantage is 0" in text and "reward mean was 0.00" in text
    assert "--warm-steps" in text and "--group-size" in text


def test_half_or_fewer_skipping_says_nothing():
    assert _run([None, EQUAL] * 4) == []  # at most half at every step
    assert _run([None] * 6) == []


def test_a_short_run_is_judged_at_its_end_and_each_reason_gets_its_advice():
    nonfinite = "no update (non-finite gradient, skipped)"
    seen = _run([nonfinite, nonfinite], total=2)
    assert len(seen) == 1 and "2 of 2 steps" in str(seen[0].message) and "--lr" in str(seen[0].message)
    masked = no_update_reason({"nonfinite_grad": 0.0, "skipped_zero_advantage": 0.0,
                               "skipped_no_loss_tokens": 1.0}, groups=1)
    assert "no loss term" in str(_run([masked], total=1)[0].message)


@pytest.mark.parametrize("norm,shown", [(1.34, "gradient norm 1.34"), (None, "loss 0.000000:")])
def test_the_loss_note_explains_an_on_policy_loss_of_about_zero(norm, shown):
    note = loss_note(1e-9, norm)
    assert shown in note and "about 0 by construction" in note
