"""The scale policies as pure functions: hand-computed state sequences."""

import numpy as np
import pytest

from tf_adaptive_scale.rules import scale_policy as sp


def state(log2_scale=10.0, log2_ceiling=127.0, growth_count=0, overflow_streak=0,
          steps_to_measure=0, calibrated=True):
    return sp.ScaleState(
        np.asarray(log2_scale, "float32"), np.asarray(log2_ceiling, "float32"),
        np.int32(growth_count), np.int32(overflow_streak),
        np.int32(steps_to_measure), np.bool_(calibrated),
    )


def clean(proposed=None, measured=True, seen=True):
    return sp.Observation(
        finite=True, loss_finite=True, measured=measured,
        proposed=np.asarray(0.0 if proposed is None else proposed, "float32"),
        seen=np.asarray(seen),
    )


OVERFLOW = sp.Observation(finite=False, loss_finite=True, measured=False)
BAD_DATA = sp.Observation(finite=False, loss_finite=False, measured=False)


def values(s):
    """A state as plain Python values, for comparisons."""
    return {k: np.asarray(v).tolist() for k, v in s._asdict().items()}


def run(policy, s, observations):
    trail = []
    for o in observations:
        s = policy.next_state(s, o)
        trail.append(values(s))
    return trail


def field(trail, name):
    return [t[name] for t in trail]


def test_dynamic_grows_backs_off_with_hysteresis_within_bounds():
    policy = sp.DynamicScaling(update_every=100, growth_steps=2, hysteresis=2,
                               log2_min=8.0, log2_max=11.0)
    c = clean(measured=False)
    trail = run(policy, state(10.0), [c, c, c, c, OVERFLOW, c, OVERFLOW, OVERFLOW,
                                      OVERFLOW, OVERFLOW, OVERFLOW, OVERFLOW])
    assert field(trail, "log2_scale") == [10, 11, 11, 11, 11, 11, 11, 10, 10, 9, 9, 8]
    assert field(trail, "overflow_streak") == [0, 0, 0, 0, 1, 0, 1, 2, 3, 4, 5, 6]
    # Growth counts clean steps since the last growth; an overflow resets it.
    assert field(trail, "growth_count")[:6] == [1, 0, 1, 0, 0, 1]
    floor = run(policy, state(8.0, overflow_streak=1), [OVERFLOW])
    assert floor[0]["log2_scale"] == 8  # at the floor


def test_bad_data_skips_without_backing_off_in_every_mode():
    s = state(10.0, log2_ceiling=12.0, growth_count=5, overflow_streak=0)
    for policy in (sp.DynamicScaling(100, 2000, 1, -32.0, 24.0),
                   sp.AdaptiveScaling(100, 1, -32.0, 24.0),
                   sp.StaticScaling(100)):
        trail = run(policy, s, [BAD_DATA] * 30)
        assert field(trail, "log2_scale") == [10.0] * 30
        assert trail[-1]["log2_ceiling"] == 12.0 and trail[-1]["growth_count"] == 5
        assert trail[-1]["overflow_streak"] == 0


def test_none_holds_scale_one_whatever_was_restored():
    trail = run(sp.NoScaling(100), state(10.0), [clean(), OVERFLOW])
    assert field(trail, "log2_scale") == [0.0, 0.0]


def test_adaptive_takes_the_rule_within_bounds_and_rise_cap():
    policy = sp.AdaptiveScaling(100, 1, -4.0, 20.0, max_rise=3)
    trail = run(policy, state(10.0), [clean(12.0), clean(30.0), clean(-9.0), clean(0.0)])
    # +2; +3 (rise cap, not 30 or max 20); falls are never capped (floor -4);
    # then +3 again.
    assert field(trail, "log2_scale") == [12, 15, -4, -1]
    assert field(trail, "log2_ceiling") == [20, 20, 20, 20]  # no cap left after clean steps


def test_adaptive_ignores_steps_that_saw_only_zeros_once_calibrated():
    policy = sp.AdaptiveScaling(100, 1, -32.0, 24.0)
    trail = run(policy, state(10.0), [clean(proposed=-3.0, seen=False)])
    assert trail[0]["log2_scale"] == 10 and trail[0]["steps_to_measure"] == 99


def test_uncalibrated_zeros_raise_the_guess_and_measure_again():
    policy = sp.AdaptiveScaling(100, 1, -32.0, 24.0)
    trail = run(policy, state(10.0, calibrated=False),
                [clean(seen=False), clean(seen=False), clean(14.0)])
    assert field(trail, "log2_scale") == [18, 24, 14]  # +8, +8 up to max, then the rule
    assert field(trail, "steps_to_measure") == [0, 0, 99]
    assert field(trail, "calibrated") == [False, False, True]


def test_uncalibrated_overflow_drops_39_binades_then_the_rule_sets_the_scale():
    policy = sp.AdaptiveScaling(100, 1, -32.0, 24.0)
    trail = run(policy, state(15.0, calibrated=False),
                [OVERFLOW, clean(-9.0), clean(measured=False)])
    assert field(trail, "log2_scale") == [-24, -9, -9]
    # The failed guess bounds the search for a visible gradient only: the
    # clean measurement's scale is the rule's, and the cap is lifted.
    assert trail[0]["log2_ceiling"] == 14
    assert trail[1]["log2_ceiling"] == 24
    assert field(trail, "steps_to_measure") == [0, 99, 98]
    far = run(policy, state(-10.0, calibrated=False), [OVERFLOW])
    assert far[0]["log2_scale"] == -32  # not below min_scale


def test_a_blind_search_stops_below_an_overflow_then_halves():
    """Before calibration, all-zero measurements rise 8 binades at a time,
    never past one binade below the guess that overflowed; an overflow
    there halves (the search already saw nothing below)."""
    policy = sp.AdaptiveScaling(100, 1, -32.0, 24.0)
    unseen = clean(seen=False)
    trail = run(policy, state(15.0, calibrated=False),
                [OVERFLOW] + [unseen] * 5 + [OVERFLOW, unseen])
    assert field(trail, "log2_scale") == [-24, -16, -8, 0, 8, 14, 13, 13]
    assert field(trail, "log2_ceiling") == [14, 14, 14, 14, 14, 14, 13, 13]
    s0 = state(15.0, calibrated=False)
    assert bool(policy.blind(s0, True, False))
    assert not bool(policy.blind(s0, True, True))  # seen: the rule decides
    assert not bool(policy.blind(s0._replace(log2_ceiling=15.0), True, False))
    assert not bool(sp.DynamicScaling(100, 2000, 1, -16.0, 24.0).blind(s0, True, False))


def test_adaptive_overflow_halves_caps_and_clean_measurements_lift_the_cap():
    policy = sp.AdaptiveScaling(100, 1, -32.0, 24.0)
    trail = run(policy, state(14.0), [OVERFLOW, clean(14.0), clean(measured=False),
                                      clean(14.0)])
    assert field(trail, "log2_scale") == [13, 13, 13, 14]
    assert field(trail, "log2_ceiling") == [13, 14, 14, 15]
    assert field(trail, "steps_to_measure") == [0, 99, 98, 99]


def test_consecutive_back_offs_double_their_step():
    policy = sp.AdaptiveScaling(100, 1, -60.0, 24.0)
    trail = run(policy, state(14.0), [OVERFLOW] * 8)
    assert field(trail, "log2_scale") == [13, 11, 7, -1, -17, -49, -60, -60]
    again = run(policy, state(14.0), [OVERFLOW, clean(measured=False), OVERFLOW])
    assert field(again, "log2_scale") == [13, 13, 12]  # a clean step restarts at 1


def test_a_burst_of_overflows_costs_one_binade_after_one_clean_measurement():
    policy = sp.AdaptiveScaling(100, 1, -32.0, 24.0)
    trail = run(policy, state(14.0), [OVERFLOW] * 30 + [clean(14.0)] + [clean(14.0)])
    assert trail[29]["log2_scale"] == -32 and trail[29]["log2_ceiling"] == -32
    assert trail[30]["log2_scale"] == 13 and trail[31]["log2_scale"] == 14


def test_adaptive_hysteresis_backs_off_only_after_consecutive_overflows():
    policy = sp.AdaptiveScaling(100, 3, -32.0, 24.0)
    c = clean(measured=False)
    trail = run(policy, state(14.0), [OVERFLOW, OVERFLOW, c, OVERFLOW, OVERFLOW, OVERFLOW])
    assert field(trail, "log2_scale") == [14, 14, 14, 14, 14, 13]
    assert field(trail, "overflow_streak") == [1, 2, 0, 1, 2, 3]
    # Every overflow measures the next step, held back or not.
    assert field(trail, "steps_to_measure") == [0, 0, 0, 0, 0, 0]


def test_measurement_schedule_counts_down():
    policy = sp.AdaptiveScaling(3, 1, -32.0, 24.0)
    c = clean(measured=False)
    trail = run(policy, state(10.0), [clean(10.0), c, c, clean(10.0), BAD_DATA, c])
    assert field(trail, "steps_to_measure") == [2, 1, 0, 2, 1, 0]


def units(*rows, **kw):
    return np.asarray(rows, kw.get("dtype", "float32"))


def per_layer_observation(finite, proposed, seen, origins, involved, weight_only,
                          measured=True):
    return sp.Observation(
        finite=finite, loss_finite=True, measured=measured,
        proposed=units(*proposed), seen=units(*seen, dtype=bool),
        origins=units(*origins, dtype=bool), involved=units(*involved, dtype=bool),
        weight_only=units(*weight_only, dtype=bool),
    )


def per_layer_state(scales, ceilings=None, **kw):
    ceilings = [127.0] * len(scales) if ceilings is None else ceilings
    return state(units(*scales), units(*ceilings), **kw)


def test_per_layer_clean_step_sets_every_unit_and_rises_unseen_ones():
    policy = sp.PerLayerScaling(100, 1, -32.0, 64.0)
    obs = per_layer_observation(True, [5.0, 40.0, 70.0, 0.0], [True, True, True, False],
                                [False] * 4, [False] * 4, [False] * 4)
    new = values(policy.next_state(per_layer_state([3.0, 3.0, 3.0, 3.0]), obs))
    assert new["log2_scale"] == [5, 40, 64, 11]  # rule, rule, max, +8 unseen


def test_per_layer_overflow_backs_off_origins_and_what_it_reached():
    policy = sp.PerLayerScaling(100, 1, -32.0, 64.0)
    # unit 0 untouched, 1 origin, 2 received it, 3 origin of a weight-sum overflow
    obs = per_layer_observation(False, [12.0, 9.0, 7.0, 6.0], [True] * 4,
                                [False, True, False, True], [False, True, True, True],
                                [False, False, False, True])
    new = values(policy.next_state(per_layer_state([10.0, 10.0, 10.0, 10.0]), obs))
    # rule; min(rule, current)-1; as far down as the origin (a weight-sum
    # overflow reaches nothing); -4
    assert new["log2_scale"] == [12, 8, 8, 2]
    assert new["log2_ceiling"] == [127, 8, 127, 5]  # origins capped one binade down only
    assert new["steps_to_measure"] == 0
    unmeasured = obs._replace(measured=False)
    held = values(policy.next_state(per_layer_state([10.0] * 4), unmeasured))
    assert held["log2_scale"] == [10] * 4  # no statistics: nothing to blame yet


def test_per_layer_hysteresis_holds_the_back_off():
    policy = sp.PerLayerScaling(100, 2, -32.0, 64.0)
    obs = per_layer_observation(False, [12.0, 9.0], [True, True], [False, True],
                                [False, True], [False, False])
    first = policy.next_state(per_layer_state([10.0, 10.0]), obs)
    assert values(first)["log2_scale"] == [12, 10] and values(first)["overflow_streak"] == 1
    second = values(policy.next_state(first, obs))
    assert second["log2_scale"] == [12, 8]


def test_per_layer_caps_rise_again_after_clean_measurements():
    policy = sp.PerLayerScaling(100, 1, -32.0, 64.0)
    s = per_layer_state([8.0, 30.0], [8.0, 127.0])
    obs = per_layer_observation(True, [12.0, 30.0], [True, True], [False] * 2,
                                [False] * 2, [False] * 2)
    trail = run(policy, s, [obs, obs, obs])
    assert field(trail, "log2_scale") == [[11, 30], [12, 30], [12, 30]]


def test_per_layer_uncalibrated_overflow_takes_the_units_below_down_too():
    policy = sp.PerLayerScaling(100, 1, -32.0, 64.0)
    obs = per_layer_observation(False, [0.0, -20.0, 0.0], [True, True, False],
                                [False, True, False], [False, True, True],
                                [False, False, False])
    first = values(policy.next_state(per_layer_state([0.0, 0.0, 0.0], calibrated=False), obs))
    assert first["log2_scale"] == [0, -21, -29]  # 8 more for its weight sums
    later = values(policy.next_state(per_layer_state([0.0, 0.0, 0.0], calibrated=True), obs))
    assert later["log2_scale"] == [0, -21, -21]  # as far as the origin dropped


@pytest.mark.parametrize("scaling, kind", [
    ("none", sp.NoScaling), ("static", sp.StaticScaling), ("dynamic", sp.DynamicScaling),
    ("adaptive", sp.AdaptiveScaling), ("per_layer", sp.PerLayerScaling),
])
def test_make_policy_resolves_each_mode(scaling, kind):
    assert type(sp.make_policy(scaling, 100, 2000, 1, -32.0, 24.0)) is kind
