"""bench/precision_effects.py on small shapes: our fp32 paths sit at the bf16 rounding floor, the record's bf16
emulations are measurably (and finitely) further from float64."""
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import precision_effects as pe  # noqa: E402


def finite_positive(x: float) -> bool:
    return math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def ce():
    return pe.measure_ce(tokens=32, vocab=4096, sigma=4.0, target_loss=3.5, seed=0, chunk=16)


def test_ce_logits_are_tuned_to_the_requested_loss(ce):
    assert ce["mean_loss_nats_float64"] == pytest.approx(3.5, abs=1e-3)
    assert ce["config"]["max_softcapped_logit"] < 30.0 + 1e-9


def test_ce_ours_is_at_the_bf16_floor_and_the_record_emulations_are_worse(ce):
    v, floor = ce["variants"], ce["floor"]["grad_bf16_rel_err"]
    assert finite_positive(floor)
    assert v["ours"]["grad_bf16_rel_err"] <= floor * 1.01
    assert v["ours"]["grad_fp32_rel_err_before_bf16_rounding"] < 1e-5
    assert v["record_compiled_fp32"]["grad_bf16_rel_err"] <= floor * 1.01
    for k in ("record_compiled_z_bf16", "record_eager_bf16"):
        assert finite_positive(v[k]["grad_bf16_rel_err"])
        assert v[k]["grad_bf16_rel_err"] > 1.2 * v["ours"]["grad_bf16_rel_err"]
        assert v[k]["loss_per_token_rel_err"] > 100 * v["ours"]["loss_per_token_rel_err"]
        assert 0 < v[k]["e5m2_values_differing_from_ours"] < 1
    assert v["record_eager_bf16"]["grad_bf16_rel_err"] > v["record_compiled_z_bf16"]["grad_bf16_rel_err"]
    assert v["ours"]["e5m2_values_differing_from_ours"] == 0
    # the e5m2 rounding dwarfs the bf16 one
    assert v["ours"]["grad_e5m2_rel_err"] > 10 * v["ours"]["grad_bf16_rel_err"]


def test_gate_polar_express_ours_is_far_closer_to_float64_than_the_bf16_loop():
    res = pe.measure_gate_polar(draws=10, seed=0)
    for case in res.values():
        e = case["output_rel_err"]
        assert e["ours_fp32_before_rounding"]["max"] < 1e-4
        assert e["ours"]["median"] <= 1.5 * case["floor_rel_err_median"]
        for k in ("record_kernels_bf16", "bf16_torch_ops_every_op_rounded"):
            assert finite_positive(e[k]["median"]) and math.isfinite(e[k]["max"])
            assert e[k]["median"] > 5 * e["ours"]["median"]


def test_polar_record_emulation_keeps_shape_and_dtype():
    G = torch.randn(3, 12, 6).bfloat16()  # tall: the loop runs on the transpose
    out = pe.polar_record(G)
    assert out.shape == G.shape and out.dtype == torch.bfloat16
    assert pe.rel_err(out, pe.tg.polar_express_reference(G.double(), dtype=torch.float64)) < 0.2


def test_normuon_ours_is_at_least_as_close_to_float64_as_the_record_casts():
    cases = {"gate": ((10, 6, 12), torch.bfloat16), "matrix": ((2, 128, 64), torch.float32)}
    res = pe.measure_normuon(cases=cases, steps=4, seed=0)
    for case in res.values():
        e = case["output_rel_err"]
        assert finite_positive(e["record"]["mean"]) and finite_positive(e["ours"]["mean"])
        assert e["ours"]["mean"] <= e["record"]["mean"]
    assert res["matrix"]["output_rel_err"]["ours"]["last"] <= 1.01 * res["matrix"]["output_floor_rel_err_last"]


def test_adam_fused_step_is_closer_to_float64_than_the_eager_bf16_step():
    res = pe.measure_adam(shape=(256, 128), steps=5, seed=0)
    v = res["variants"]
    for k in v:
        assert finite_positive(v[k]["update_rel_err"])
        assert 0 <= v[k]["params_differing_from_record_eager"] <= 1
    assert v["record_eager_bf16"]["params_differing_from_record_eager"] == 0
    assert v["ours_compiled"]["update_rel_err"] < v["record_eager_bf16"]["update_rel_err"]
    assert v["ours_eager"]["update_rel_err"] < v["record_eager_bf16"]["update_rel_err"]
    assert v["bf16_param_fp64_states"]["update_rel_err"] <= 1.05 * v["ours_compiled"]["update_rel_err"]
    assert v["ours_compiled"]["params_differing_from_record_eager"] > 0


def test_adam_float64_reference_matches_the_closed_form_first_step():
    p, g = torch.zeros(4, dtype=torch.float64), torch.full((4,), 1e-3, dtype=torch.bfloat16)
    m, v = torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    step_size = 0.6 * math.sqrt(1 - 0.95) / (1 - 0.65)
    pe.adam_float64(p, g, m, v, step_size, 0.65, 0.95, 0.0)
    assert torch.allclose(p, torch.full((4,), -0.6, dtype=torch.float64))  # Adam's first step is lr·sign(g)


def test_verdicts_are_one_line_each(ce):
    nm = pe.measure_normuon(cases={"attn_gate x": ((10, 6, 12), torch.bfloat16),
                                   "mlp x": ((2, 128, 64), torch.float32)}, steps=2)
    gp = pe.measure_gate_polar(draws=3)
    ad = pe.measure_adam(shape=(32, 16), steps=2)
    out = pe.verdicts(ce, nm, gp, ad)
    assert set(out) == {"softcap_ce", "normuon_second_moment", "gate_polar_express", "distadam"}
    assert all(isinstance(s, str) and s and "\n" not in s for s in out.values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_compiled_check_needs_a_gpu(capsys):
    assert pe.main(["--compiled-check"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
