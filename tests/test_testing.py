"""The tolerance rule itself (``tileattn.testing.check_close``) and the tests' shared checkers built on it
(``helpers.check_lse``): what must pass, and mutations that must fail: a NaN or an inf in the output, the
reference or the PyTorch baseline, an output off by more than the rule, a NaN where the reference is finite.
Then the seeding of the GPU cases' inputs, which must replay in a new process."""

import ast
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import oracle
from helpers import case_seed, check_lse, delta_rounding, gluon_case_inputs
from tileattn.testing import check_close, rounding_floor

F16, F32, F64 = torch.float16, torch.float32, torch.float64
NAN, INF = math.nan, math.inf


def _case(n=64):
    """An fp64 reference, its fp16 rounding (the PyTorch baseline) and an fp16 output as good as it."""
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(n, generator=g, dtype=F64)
    lowp = (ref + 0.05).to(F16)  # a baseline off by ~0.05, well above the rounding floor (~5e-3)
    return ref, lowp, ref.to(F16)


def _with(t, index, value):
    t = t.clone()
    t[index] = value
    return t


def test_passes_within_the_rule():
    ref, lowp, out = _case()
    check_close("exact rounding", out, ref, lowp)
    base = (lowp.double() - ref).abs().max().item()
    # off by just under 2x the baseline's error (the floor and fp16 rounding of the output aside)
    check_close("near the bound", (ref + 1.9 * base).to(F16), ref, lowp)
    check_close("empty", out[:0], ref[:0], lowp[:0])


def test_fails_past_the_rule():
    ref, lowp, out = _case()
    base = (lowp.double() - ref).abs().max().item()
    with pytest.raises(AssertionError, match="max error"):
        check_close("2.5x the baseline", _with(out, 5, ref[5] + 2.5 * base), ref, lowp)
    with pytest.raises(AssertionError, match=r"at \(7,\)"):
        check_close("one element off", _with(out, 7, out[7] + 1), ref, lowp)
    # a baseline as exact as the output leaves only the rounding floor
    with pytest.raises(AssertionError):
        check_close("above the floor", _with(out, 3, ref[3] + 3 * rounding_floor(ref, F16)), ref, ref.to(F16))
    with pytest.raises(AssertionError, match="shape"):
        check_close("shape", out[:3], ref, lowp)
    with pytest.raises(AssertionError, match="shape"):
        check_close("baseline shape", out, ref, lowp[:3])


@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_non_finite_output_fails(value):
    ref, lowp, out = _case()
    with pytest.raises(AssertionError, match="reference"):
        check_close("output", _with(out, 11, value), ref, lowp)


@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_non_finite_reference_must_be_matched(value):
    ref, lowp, out = _case()
    ref_bad = _with(ref, 11, value)
    # the output finite where the reference is not, even with a baseline that agrees with the reference
    with pytest.raises(AssertionError, match="reference is"):
        check_close("finite output", out, ref_bad, _with(lowp, 11, value))
    with pytest.raises(AssertionError, match="reference is"):
        check_close("finite output, finite baseline", out, ref_bad, lowp)
    # matched exactly, the rest still held to the rule
    check_close("matched", _with(out, 11, value), ref_bad, _with(lowp, 11, value))
    check_close("matched, finite baseline", _with(out, 11, value), ref_bad, lowp)
    with pytest.raises(AssertionError, match="max error"):
        check_close("matched, rest wrong", _with(_with(out, 11, value), 2, 5.0), ref_bad, lowp)


def test_infinities_of_the_other_kind_fail():
    ref, lowp, out = _case()
    for want, got in ((INF, -INF), (-INF, INF), (INF, NAN), (NAN, INF), (NAN, -INF)):
        with pytest.raises(AssertionError, match="reference is"):
            check_close(f"{got} for {want}", _with(out, 4, got), _with(ref, 4, want), lowp)


@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_non_finite_baseline_is_an_error_of_the_test(value):
    """A baseline that is not finite where the reference is would make the bound infinite or NaN, which
    passed anything (an output of 5.0 against a reference of 1.0)."""
    ref, lowp, out = _case()
    with pytest.raises(ValueError, match="baseline"):
        check_close("good output", out, ref, _with(lowp, 11, value))
    with pytest.raises((ValueError, AssertionError)):
        check_close("wrong output", torch.full_like(out, 5.0), torch.ones_like(ref), _with(lowp, 0, value))


def test_nan_where_the_reference_is_finite_fails_whatever_the_baseline():
    ref, lowp, out = _case()
    with pytest.raises(AssertionError, match="non-finite"):
        check_close("nan output", _with(out, 0, NAN), ref, lowp)
    # with the floor set elsewhere (the gradients' rule) too
    with pytest.raises(AssertionError, match="non-finite"):
        check_close("nan output", _with(out, 0, NAN), ref, lowp, floor_scale=torch.tensor([1.0, 2.0]))


def test_floor_scale_and_floor():
    ref, lowp, out = _case()
    # the floor is taken at the largest finite magnitude, not at an infinity of the reference
    assert rounding_floor(_with(ref, 0, INF), F16) == rounding_floor(_with(ref, 0, 0.0), F16)
    assert math.isfinite(rounding_floor(torch.tensor([INF, -INF]), F16))
    with pytest.raises(ValueError, match="floor_scale"):
        check_close("nan floor scale", out, ref, lowp, floor_scale=torch.tensor([NAN]))
    # a larger floor scale widens the floor: an error of 0.1 on values ~1 passes at scale 1000 in fp16
    wide = _with(out, 1, ref[1] + 0.1)
    with pytest.raises(AssertionError):
        check_close("floor at ref", wide, ref, ref.to(F16))
    check_close("floor at 1000", wide, ref, ref.to(F16), floor_scale=torch.tensor([1000.0]))


def test_allowance_widens_the_bound_and_must_be_a_size():
    ref, _, out = _case()
    off = _with(out, 1, ref[1] + 0.1)
    with pytest.raises(AssertionError, match="allowance 5.000e-02"):
        check_close("allowance too small", off, ref, ref.to(F16), allowance=0.05)
    check_close("allowance enough", off, ref, ref.to(F16), allowance=0.1)
    for bad in (NAN, INF, -1e-3):
        with pytest.raises(ValueError, match="allowance"):
            check_close("bad allowance", out, ref, ref.to(F16), allowance=bad)


def _flash_backward(q, k, v, dout, o_stored, scale, keep, p_drop, seen):
    """A FlashAttention backward written out in fp64 (no oracle code): Δ from the stored ``o_stored``."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    s = s.masked_fill(~seen, -INF)
    has_key = seen.any(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(~has_key, 0.0), -1).masked_fill(~seen, 0.0)
    dp = torch.einsum("bqhd,bkhd->bhqk", dout, v) * keep / (1 - p_drop)
    delta = (dout * o_stored).sum(-1).transpose(1, 2).unsqueeze(-1)  # (b, h, q, 1)
    ds = p * (dp - delta)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, k) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    return dq, dk.unflatten(2, (-1, group)).sum(3)


@pytest.mark.parametrize("seqlen_q, seqlen_k, headdim, scale", [(36, 1, 256, 0.9), (45, 29, 64, 0.05)])
def test_delta_rounding_is_what_the_stored_output_does_to_the_gradients(seqlen_q, seqlen_k, headdim, scale):
    """``helpers.delta_rounding`` against a FlashAttention backward written out in fp64 that reads a
    rounded O (causal with Sq > Sk: rows with no key and rows with one; GQA; dropout): the gradients of
    that backward minus the exact ones are the shift it computes; and with one key per row, where the
    exact dq is 0, the shift is all the error, beyond 2 ulps of the largest gradient at head dim 256 (the
    H100 run of 2026-12-07 that found this: 0.0236 against a floor of 0.0065)."""
    g = torch.Generator().manual_seed(seqlen_q)
    q, k, v = (
        torch.randn(2, n, h, headdim, generator=g, dtype=F64) for n, h in ((seqlen_q, 4), (seqlen_k, 2), (seqlen_k, 2))
    )
    dout = torch.randn(2, seqlen_q, 4, headdim, generator=g, dtype=F64)
    keep = torch.rand(2, 4, seqlen_q, seqlen_k, generator=g) > 0.17
    kwargs = dict(softmax_scale=scale, causal=True, dropout_p=0.17, dropout_mask=keep)
    exact = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = oracle.attention(*exact, **kwargs, lse_grad=True)
    dq_ref, dk_ref, dv_ref = torch.autograd.grad(ref.out, exact, dout, retain_graph=True)
    stored = ref.out.detach().to(F16)
    seen = oracle.visible(seqlen_q, seqlen_k, None, 0, seqlen_q, seqlen_k)[None, None]
    dq, dk = _flash_backward(q, k, v, dout, stored.double(), scale, keep, 0.17, seen)
    shift_q, shift_k = delta_rounding(stored, ref, dout, exact)
    torch.testing.assert_close(shift_q, dq - dq_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(shift_k, dk - dk_ref, rtol=0, atol=1e-10)
    assert shift_q.abs().max() > 0 and shift_k.abs().max() > 0
    if seqlen_k == 1:
        assert dq_ref.abs().max() < 1e-12 and dk_ref.abs().max() < 1e-12
        floor = rounding_floor(torch.stack([t.abs().max() for t in (dq_ref, dk_ref, dv_ref)]), F16)
        assert shift_q.abs().max() > floor and shift_k.abs().max() > floor


def test_check_lse():
    """+inf exactly in the rows that see no key; the rule on the others; the baseline must be finite there."""
    ref = torch.tensor([[1.0, INF, 2.5, INF]], dtype=F64)
    lowp = torch.tensor([[1.001, INF, 2.499, INF]], dtype=F32)
    check_lse("lse", ref.float(), ref, lowp)
    with pytest.raises(AssertionError):
        check_lse("finite in a hidden row", _with(ref.float(), (0, 1), 3.0), ref, lowp)
    with pytest.raises(AssertionError):
        check_lse("-inf in a hidden row", _with(ref.float(), (0, 1), -INF), ref, lowp)
    with pytest.raises(AssertionError):
        check_lse("inf in a visible row", _with(ref.float(), (0, 0), INF), ref, lowp)
    with pytest.raises(AssertionError):
        check_lse("nan in a visible row", _with(ref.float(), (0, 2), NAN), ref, lowp)
    with pytest.raises(AssertionError):
        check_lse("off", _with(ref.float(), (0, 2), 2.6), ref, lowp)
    with pytest.raises(ValueError):
        check_lse("inf baseline", ref.float(), ref, _with(lowp, (0, 0), INF))


def test_case_inputs_replay_in_a_new_process():
    """A Gluon case's inputs come from a seed derived from the case's text: two processes (each with its own
    string hashing) draw the same tensors, on the CPU and, where there is one, on the GPU."""
    case = (2, 37, 53, 4, 2, 64, True, torch.bfloat16)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    script = (
        "import hashlib, sys, torch; sys.path.insert(0, sys.argv[1]); import helpers\n"
        f"for device in {devices!r}:\n"
        f"    tensors = helpers.gluon_case_inputs({case!r}, 4, device)\n"
        "    print(device, helpers.case_seed(" + repr(case) + "), "
        "hashlib.sha256(b''.join(t.cpu().view(torch.int16).numpy().tobytes() for t in tensors)).hexdigest())\n"
    )
    outputs = []
    for hashseed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hashseed}
        run = subprocess.run(
            [sys.executable, "-c", script, str(Path(__file__).parent)], capture_output=True, text=True, env=env
        )
        assert run.returncode == 0, run.stderr
        outputs.append([line for line in run.stdout.splitlines() if not line.startswith("inputs of")])
    assert outputs[0] == outputs[1] and len(outputs[0]) == len(devices), outputs
    # and they are the inputs this process draws
    assert str(case_seed(case)) in outputs[0][0]
    assert gluon_case_inputs(case, 4, "cpu")[0].shape == (2, 37, 4, 64)


def test_gpu_property_examples_replay_from_the_printed_seed():
    """The GPU property tests draw fresh examples each run and print the seed that replays them: a new
    process given TILEATTN_HYPOTHESIS_SEED draws the same examples (run_property's GPU branch, driven with a
    check that records them; no GPU needed), and two fresh runs draw different ones."""
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); import helpers\n"
        "from hypothesis import strategies as st\n"
        "seen = []\n"
        "helpers.run_property(lambda _, ex: seen.append(ex), st.integers(0, 10**9), {'cuda': 30}, 'cuda', 1)\n"
        "print(seen)\n"
    )

    def run(seed=None):
        env = {k: v for k, v in os.environ.items() if k not in ("TILEATTN_HYPOTHESIS_SEED", "TILEATTN_SLOW")}
        env.update({"TILEATTN_HYPOTHESIS_SEED": seed} if seed else {})
        out = subprocess.run(
            [sys.executable, "-c", script, str(Path(__file__).parent)], capture_output=True, text=True, env=env
        )
        assert out.returncode == 0, out.stderr
        printed, examples = out.stdout.splitlines()[-2:]
        return printed, examples

    printed, fresh = run()
    assert printed.startswith("hypothesis seed ") and "TILEATTN_HYPOTHESIS_SEED=" in printed, printed
    given_seed = printed.split("TILEATTN_HYPOTHESIS_SEED=")[1].split()[0]
    assert int(printed.split()[2].rstrip(":")) == int(given_seed) + 1  # (shard 1)
    assert run(given_seed) == (printed, fresh)
    assert run()[1] != fresh
    assert len(ast.literal_eval(fresh)) >= 5


def test_shards_split_the_suite():
    """``TILEATTN_SHARD=i/n`` (tests/conftest.py): the n shards' collections of a file are disjoint and together
    its whole collection, none empty here; a malformed value is refused by name (pytest's usage error)."""
    root = Path(__file__).parent

    def collect(shard=None):
        env = {k: v for k, v in os.environ.items() if k not in ("TILEATTN_SHARD", "PYTEST_XDIST_WORKER_COUNT")}
        env.update({"TILEATTN_SHARD": shard} if shard else {})
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "test_oracle.py"],
            capture_output=True, text=True, env=env, cwd=root,
        )  # fmt: skip
        return run.returncode, [line for line in run.stdout.splitlines() if "::" in line], run.stdout + run.stderr

    code, every, _ = collect()
    assert code == 0 and len(every) > 10
    shards = [collect(f"{i}/2")[1] for i in range(2)]
    assert all(shards) and sorted(sum(shards, [])) == sorted(every)
    for bad in ("2/2", "a/2"):
        code, _, text = collect(bad)
        assert code == 4 and "TILEATTN_SHARD must be i/n" in text, (bad, code, text[-500:])
