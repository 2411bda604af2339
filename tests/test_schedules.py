"""SPEC §7 schedules with the default (record) Hyperparameters."""
import pytest

import train_gpt as tg

A = tg.Hyperparameters()


def test_total_steps():
    assert A.num_iterations == 2160


@pytest.mark.parametrize("step,bs", [(0, 131072), (706, 131072), (707, 262144), (1413, 262144),
                                     (1414, 393216), (2119, 393216), (2120, 393216), (2159, 393216)])
def test_get_bs_boundaries(step, bs):
    assert tg.get_bs(step, A) == bs


def test_total_training_tokens():
    assert sum(tg.get_bs(s, A) for s in range(A.num_iterations)) == 571_342_848


@pytest.mark.parametrize("step,ws", [(0, (1, 3)), (706, (1, 3)), (707, (3, 7)), (1413, (3, 7)),
                                     (1414, (5, 11)), (2119, (5, 11)), (2120, (6, 13)), (2159, (6, 13)),
                                     (2160, (6, 13))])
def test_get_ws_boundaries(step, ws):
    assert tg.get_ws(step, A) == ws


def test_ws_and_bs_change_together():
    changes_bs = [s for s in range(1, 2160) if tg.get_bs(s, A) != tg.get_bs(s - 1, A)]
    changes_ws = [s for s in range(1, 2161) if tg.get_ws(s, A) != tg.get_ws(s - 1, A)]
    assert changes_bs == [707, 1414]
    assert changes_ws == [707, 1414, 2120]


@pytest.mark.parametrize("step,lr", [(0, 1.0), (699, 1.0), (700, 1.51), (953, 1.51), (954, 1.51),
                                     (1399, 0.9719), (1400, 1.2300), (1413, 1.2096), (2000, 0.2883),
                                     (2119, 0.1016), (2120, 0.1), (2159, 0.1), (2160, 0.1)])
def test_get_lr_values(step, lr):
    assert tg.get_lr(step, A) == pytest.approx(lr, abs=1e-4)


def test_get_lr_exact_formula_in_cooldown():
    for step in (954, 1000, 1399, 1400, 1413, 2000, 2119):
        x = step / 2120
        m = 1.93 if x > 0.66 else 1.51
        w = (1 - x) / 0.55
        assert tg.get_lr(step, A) == pytest.approx(m * w + 0.1 * (1 - w), rel=1e-12)


def test_get_lr_upward_jump_at_1400():
    before, after = tg.get_lr(1399, A), tg.get_lr(1400, A)
    assert after - before == pytest.approx(1.2300 - 0.9719, abs=2e-4)
    # otherwise non-increasing inside the cooldown
    for s in range(955, 2160):
        if s != 1400:
            assert tg.get_lr(s, A) <= tg.get_lr(s - 1, A) + 1e-12


def test_get_lr_plateau_before_cooldown():
    assert {tg.get_lr(s, A) for s in range(0, 700)} == {1.0}
    assert {tg.get_lr(s, A) for s in range(700, 954)} == {1.51}


@pytest.mark.parametrize("step,m", [(0, 0.85), (150, 0.90), (300, 0.95), (301, 0.95), (1000, 0.95),
                                    (2110, 0.95), (2111, 0.948), (2159, 0.852)])
def test_get_muon_momentum(step, m):
    assert tg.get_muon_momentum(step, A) == pytest.approx(m, abs=1e-9)


def test_get_stage():
    assert tg.get_stage(0, A) == 0
    assert tg.get_stage(707, A) == 1
    assert tg.get_stage(2119, A) == 2
    assert tg.get_stage(2120, A) is None


def test_smoke_preset_schedule():
    s = tg.Hyperparameters(**tg.SMOKE_PRESET)
    assert s.num_iterations == 33
    assert [tg.get_bs(k, s) for k in (0, 9, 10, 19, 20, 29, 30, 32)] == [1024] * 2 + [2048] * 2 + [3072] * 4
    assert [tg.get_ws(k, s) for k in (0, 10, 20, 30)] == [(1, 3), (3, 7), (5, 11), (6, 13)]
