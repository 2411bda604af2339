"""Schedules: the record's published values at the full length, and the record's formulas at every length.

The record's formulas are written out here independently of train_gpt.py (from its published behaviour), so a
re-implementation that agrees only at 2120+40 steps fails at the short lengths people use to test ideas.
Schedules that cannot work are refused by validate_args (tests/test_cli_and_errors.py).
"""
import pytest

import train_gpt as tg


def ws_at(step, args):
    """(short, long) attention windows in blocks at a step."""
    s = tg.stage_at(step, args)
    return s.ws_short, s.ws_long


A = tg.Hyperparameters()
LENGTHS = [(20, 3), (90, 6), (200, 10), (348, 10), (349, 10), (2120, 40)]


class RecordSchedule:
    """The December 2025 record's schedule functions for N scheduled + E extension steps."""

    def __init__(self, scheduled: int, extension: int):
        self.N, self.total = scheduled, scheduled + extension

    def bs(self, step):
        if step >= self.N:
            return 24 * 2048 * 8
        return (8 * 2048 * 8, 16 * 2048 * 8, 24 * 2048 * 8)[int(3 * (step / self.N))]

    def ws(self, step):
        if step >= self.N:
            return 13 // 2, 13
        long = (3, 7, 11)[int(3 * (step / self.N))]
        return long // 2, long

    def lr(self, step):
        if step > self.N:
            return 0.1
        x = step / self.N
        top = 1.0
        if x > 0.33:
            top = 1.51
        if x > 0.66:
            top = 1.93
        if x >= 1 - 0.55:
            w = (1 - x) / 0.55
            return top * w + (1 - w) * 0.1
        return top

    def momentum(self, step):
        cooldown_start = self.total - 50
        if step < 300:
            return 0.85 + (step / 300) * (0.95 - 0.85)
        if step > cooldown_start:
            return 0.95 - ((step - cooldown_start) / 50) * (0.95 - 0.85)
        return 0.95

    def yarn_steps(self):
        """Steps at whose top the long window changes (and YaRN is applied)."""
        return [s for s in range(1, self.total + 1) if self.ws(s)[1] != self.ws(s - 1)[1]]


def args_for(scheduled, extension):
    return tg.Hyperparameters(num_scheduled_iterations=scheduled, num_extension_iterations=extension)


@pytest.mark.parametrize("scheduled,extension", LENGTHS)
def test_every_schedule_matches_the_record_formulas_at_every_step(scheduled, extension):
    a, rec = args_for(scheduled, extension), RecordSchedule(scheduled, extension)
    for step in range(a.num_iterations + 1):
        assert tg.stage_at(step, a).batch_size == rec.bs(step), step
        assert ws_at(step, a) == rec.ws(step), step
        assert tg.get_lr(step, a) == rec.lr(step), step          # bit-equal: same float expression
        assert tg.get_muon_momentum(step, a) == rec.momentum(step), step


@pytest.mark.parametrize("scheduled,extension", LENGTHS)
def test_stage_table_first_steps_are_where_the_window_changes(scheduled, extension):
    a, rec = args_for(scheduled, extension), RecordSchedule(scheduled, extension)
    table = tg.stages(a)
    assert [s.first_step for s in table[1:]] == rec.yarn_steps()
    assert table[0].first_step == 0 and table[-1].name == "extension"
    for s in table:
        assert tg.stage_at(s.first_step, a).batch_size == s.batch_size and ws_at(s.first_step, a) == (s.ws_short, s.ws_long)
        if s.first_step > 0:
            assert ws_at(s.first_step - 1, a) != (s.ws_short, s.ws_long)


def test_short_run_never_leaves_the_momentum_warmup():
    """At 90+6 the warm-up rule wins over the cool-down: 0.85 -> 0.882, never the cool-down's 0.948 / 0.852."""
    a = args_for(90, 6)
    values = [tg.get_muon_momentum(s, a) for s in range(96)]
    assert values == sorted(values)                               # monotone ramp
    assert values[47] == pytest.approx(0.85 + 47 / 300 * 0.1)
    assert values[95] == pytest.approx(0.8817, abs=1e-4)


@pytest.mark.parametrize("scheduled,extension,first_cooldown_step",
                         [(348, 10, 309), (349, 10, 310), (2120, 40, 2111)])
def test_momentum_cooldown_starts_only_after_the_warmup(scheduled, extension, first_cooldown_step):
    a = args_for(scheduled, extension)
    assert tg.get_muon_momentum(first_cooldown_step - 1, a) == 0.95
    assert tg.get_muon_momentum(first_cooldown_step, a) < 0.95


def test_momentum_boundaries_at_300_steps():
    a = args_for(300, 10)  # cool-down would start at step 261: the warm-up still wins until 299
    assert tg.get_muon_momentum(299, a) == pytest.approx(0.85 + 299 / 300 * 0.1)
    assert tg.get_muon_momentum(300, a) < 0.95  # from 300 on the cool-down applies (300 > 310 - 50)


def test_eval_windows_are_the_stage_windows_then_the_widened_final():
    assert tg.eval_windows(A) == [(1, 3), (3, 7), (5, 11), (6, 13), (6, 20)]


# ---- the record's published values at the full schedule -------------------------------------------------------

def test_total_steps():
    assert A.num_iterations == 2160


@pytest.mark.parametrize("step,bs", [(0, 131072), (706, 131072), (707, 262144), (1413, 262144),
                                     (1414, 393216), (2119, 393216), (2120, 393216), (2159, 393216)])
def test_the_batch_size_changes_at_the_stage_boundaries(step, bs):
    assert tg.stage_at(step, A).batch_size == bs


def test_total_training_tokens():
    assert sum(tg.stage_at(s, A).batch_size for s in range(A.num_iterations)) == 571_342_848


@pytest.mark.parametrize("step,ws", [(0, (1, 3)), (706, (1, 3)), (707, (3, 7)), (1413, (3, 7)),
                                     (1414, (5, 11)), (2119, (5, 11)), (2120, (6, 13)), (2159, (6, 13)),
                                     (2160, (6, 13))])
def test_window_boundaries(step, ws):
    assert ws_at(step, A) == ws


@pytest.mark.parametrize("step,lr", [(0, 1.0), (699, 1.0), (700, 1.51), (953, 1.51), (954, 1.51),
                                     (1399, 0.9719), (1400, 1.2300), (1413, 1.2096), (2000, 0.2883),
                                     (2119, 0.1016), (2120, 0.1), (2159, 0.1), (2160, 0.1)])
def test_get_lr_values(step, lr):
    assert tg.get_lr(step, A) == pytest.approx(lr, abs=1e-4)


def test_get_lr_upward_jump_at_1400_otherwise_non_increasing_in_cooldown():
    assert tg.get_lr(1400, A) - tg.get_lr(1399, A) == pytest.approx(1.2300 - 0.9719, abs=2e-4)
    for s in range(955, 2160):
        if s != 1400:
            assert tg.get_lr(s, A) <= tg.get_lr(s - 1, A) + 1e-12


@pytest.mark.parametrize("step,m", [(0, 0.85), (150, 0.90), (300, 0.95), (301, 0.95), (1000, 0.95),
                                    (2110, 0.95), (2111, 0.948), (2159, 0.852)])
def test_get_muon_momentum_full_schedule(step, m):
    assert tg.get_muon_momentum(step, A) == pytest.approx(m, abs=1e-9)


def test_smoke_preset_schedule():
    s = tg.Hyperparameters(**tg.SMOKE_PRESET)
    assert s.num_iterations == 33
    assert [tg.stage_at(k, s).batch_size for k in (0, 9, 10, 19, 20, 29, 30, 32)] == [512] * 2 + [1024] * 2 + [1536] * 4
    assert [ws_at(k, s) for k in (0, 10, 20, 30)] == [(1, 3), (3, 7), (5, 11), (6, 13)]


# ---- short schedules log what they do at each stage switch ------------------------------------------------------

def test_schedule_line_names_stage_windows_lr_and_momentum():
    a = args_for(90, 6)
    line = tg.schedule_line(30, a)
    assert line == "schedule: step 30 stage 2: batch 262144 windows (3, 7) lr x1.5100 muon momentum 0.8600"
