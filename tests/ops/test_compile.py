"""torch.compile and torch.library: every public function is a custom op with a fake implementation
and registered autograd, so compiled models call it without graph breaks (fullgraph=True)."""

import shutil

import pytest
import torch

import oracle
import tileattn
from kvcache_ref import kvcache_ref
from tileattn.testing import check_close

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
DTYPE = torch.bfloat16 if HAS_CUDA else torch.float32
# Inductor compiles the surrounding graph (C++ on CPU); without a C++ compiler the CPU run falls back to
# aot_eager, which traces, functionalises and partitions the same way without generating code.
BACKEND = "inductor" if HAS_CUDA or shutil.which("g++") or shutil.which("c++") else "aot_eager"


def _t(*shape, grad=False, dtype=None):
    return torch.randn(*shape, device=DEVICE, dtype=dtype or DTYPE).requires_grad_(grad)


def _i32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def test_opcheck_fwd_bwd_dense_and_varlen():
    q, k, v = _t(2, 9, 4, 16, grad=True), _t(2, 7, 2, 16, grad=True), _t(2, 7, 2, 16, grad=True)
    args = (q, k, v, None, None, None, 9, 7, 0.25, -1, 0, 0.0, 0.0, False)
    torch.library.opcheck(torch.ops.tileattn.fwd.default, args)
    out, lse, rng_state = torch.ops.tileattn.fwd(*args)
    bwd_args = (
        torch.randn_like(out),
        q,
        k,
        v,
        out,
        lse,
        rng_state,
        None,
        None,
        None,
        9,
        7,
        0.25,
        -1,
        0,
        0.0,
        0.0,
        False,
    )
    # tileattn::bwd is the backward kernel and has no derivative itself (no double backward), so its
    # aot_dispatch check (which differentiates the op) is left out; the fwd check above already runs it
    # through AOT autograd as fwd's backward.
    torch.library.opcheck(
        torch.ops.tileattn.bwd.default,
        bwd_args,
        test_utils=("test_schema", "test_autograd_registration", "test_faketensor"),
    )
    cu = _i32([0, 5, 12])
    qv, kv = _t(12, 4, 16, grad=True), _t(12, 2, 16, grad=True)
    slopes = torch.rand(4, device=DEVICE)
    torch.library.opcheck(
        torch.ops.tileattn.fwd.default, (qv, kv, kv, slopes, cu, cu, 7, 7, 0.25, 3, 0, 2.0, 0.0, False)
    )


def test_opcheck_with_sinks():
    """The ops with attention sinks (the last tensor input of tileattn::fwd before the FP8 descales; the
    sinks' gradient tileattn::bwd's fourth output): schema, fake tensors and autograd through AOT dispatch."""
    q, k, v = _t(2, 9, 4, 16, grad=True), _t(2, 7, 2, 16, grad=True), _t(2, 7, 2, 16, grad=True)
    sink = torch.randn(4, device=DEVICE, requires_grad=True)
    args = (q, k, v, None, None, None, 9, 7, 0.25, -1, 0, 0.0, 0.0, False, None, False, sink)
    torch.library.opcheck(torch.ops.tileattn.fwd.default, args)
    kc, vc = _t(2, 10, 2, 16), _t(2, 10, 2, 16)
    args = (_t(2, 1, 4, 16), kc, vc, None, None, None, None, _i32([3, 7]), None, None, None, None)
    args += (0.25, -1, 0, 0.0, True, 0, 1, None, None, sink.detach())
    torch.library.opcheck(torch.ops.tileattn.fwd_kvcache.default, args)


def test_opcheck_kvcache_and_paged_varlen():
    q = _t(2, 1, 4, 16)
    kc, vc = _t(2, 10, 2, 16), _t(2, 10, 2, 16)
    k, v = _t(2, 1, 2, 16), _t(2, 1, 2, 16)
    angle = torch.rand(12, 8, device=DEVICE)
    args = (
        q, kc, vc, k, v, angle.cos().to(DTYPE), angle.sin().to(DTYPE), _i32([3, 7]), None, None, None, None,
        0.25, -1, 0, 0.0, True, 0, 1,
    )  # fmt: skip
    torch.library.opcheck(torch.ops.tileattn.fwd_kvcache.default, args)
    pool = _t(6, 4, 2, 16)
    table = _i32([[0, 1, 2], [3, 4, 5]])
    args = (_t(5, 4, 16), pool, pool, _i32([0, 2, 5]), _i32([0, 9, 19]), table, None, 3, 10, 0.25, -1, 0, 0.0)
    torch.library.opcheck(torch.ops.tileattn.fwd_paged_varlen.default, args)


class Block(torch.nn.Module):
    """Pre-norm attention block calling the public functions, with attention sinks (fp32, as gpt-oss's)."""

    def __init__(self, d=64, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.qkv = torch.nn.Linear(d, (heads + 2 * kv_heads) * self.hd)
        self.out = torch.nn.Linear(d, d)
        self.sink = torch.nn.Parameter(torch.randn(heads))

    def split(self, x):
        q, k, v = self.qkv(x).split([self.heads * self.hd, self.kv_heads * self.hd, self.kv_heads * self.hd], -1)
        return (
            q.unflatten(-1, (self.heads, self.hd)),
            k.unflatten(-1, (self.kv_heads, self.hd)),
            v.unflatten(-1, (self.kv_heads, self.hd)),
        )

    def attend(self, q, k, v, cu, max_len):
        if cu is None:
            return tileattn.flash_attn_func(q, k, v, causal=True, softcap=5.0, learnable_sink=self.sink.float())
        return tileattn.flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=True, s_aux=self.sink)

    def forward(self, x, cu=None, max_len=None):
        q, k, v = self.split(x)
        return x + self.out(self.attend(q, k, v, cu, max_len).flatten(-2))


class OracleBlock(Block):
    """The same block with the tests' oracle for its attention, computed in the parameters' precision."""

    def attend(self, q, k, v, cu, max_len):
        if cu is None:
            return oracle.attention(q, k, v, causal=True, softcap=5.0, precision=None, sink=self.sink).out
        return oracle.attention_varlen(q, k, v, cu, cu, max_len, causal=True, precision=None, sink=self.sink).out


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_compiled_model_has_no_graph_break(varlen):
    """The compiled block (fullgraph) against the block with the oracle's attention in fp64, forward and
    parameter gradients, by the tolerance rule (PyTorch's error: that block in the model's dtype)."""
    torch._dynamo.reset()
    model = Block().to(DEVICE, DTYPE)
    if varlen:
        x = _t(21, 64)
        args = (_i32([0, 4, 21]), 17)
    else:
        x = _t(2, 13, 64)
        args = ()
    compiled = torch.compile(model, fullgraph=True, backend=BACKEND)
    out = compiled(x, *args)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, list(model.parameters()), dout)
    exact, plain = OracleBlock().to(DEVICE, torch.float64), OracleBlock().to(DEVICE, DTYPE)
    exact.load_state_dict(model.state_dict())
    plain.load_state_dict(model.state_dict())
    ref, lowp = exact(x.double(), *args), plain(x, *args)
    check_close("compiled out", out, ref, lowp)
    g_ref = torch.autograd.grad(ref, list(exact.parameters()), dout.double())
    g_lowp = torch.autograd.grad(lowp, list(plain.parameters()), dout)
    scale = torch.stack([g.abs().max() for g in g_ref])
    for (name, _), g, gr, gl in zip(model.named_parameters(), grads, g_ref, g_lowp):
        check_close(f"compiled d{name}", g, gr, gl, floor_scale=scale)


def test_compiled_decode_step_writes_the_cache():
    torch._dynamo.reset()
    kc, vc = (
        torch.zeros(2, 16, 2, 16, device=DEVICE, dtype=DTYPE),
        torch.zeros(2, 16, 2, 16, device=DEVICE, dtype=DTYPE),
    )

    def step(q, k, v, seqlens):
        return tileattn.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, causal=True)

    compiled = torch.compile(step, fullgraph=True, backend=BACKEND)
    q, k, v = _t(2, 1, 4, 16), _t(2, 1, 2, 16), _t(2, 1, 2, 16)
    out = compiled(q, k, v, _i32([3, 8]))
    assert torch.equal(kc[0, 3], k[0, 0]) and torch.equal(vc[1, 8], v[1, 0]), "the compiled call did not append"
    # the oracle on the caches the call wrote, whose sequences now hold 4 and 9 keys
    ref, lowp = (
        kvcache_ref(q, kc, vc, cache_seqlens=_i32([4, 9]), causal=True, precision=p) for p in (torch.float64, None)
    )
    check_close("compiled decode", out, ref.out, lowp.out)


class _ThroughTheOps(torch.overrides.TorchFunctionMode):
    """A mode that changes nothing, under which calls go through the custom ops' dispatch (``direct`` is
    false under any mode)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_eager_calls_skip_the_dispatcher_with_the_same_results():
    """Eager calls on plain tensors run the ops' implementations directly (backend.direct); the results,
    gradients (dropout included) and cache writes equal those through the custom ops, and the caches'
    version counters move as the op's would."""
    import contextlib

    from tileattn.backend import direct as direct_rule

    q, k, v = _t(2, 37, 4, 16, grad=True), _t(2, 41, 2, 16, grad=True), _t(2, 41, 2, 16, grad=True)
    dout = torch.randn_like(q)
    kc, vc, kn, vn = _t(2, 64, 2, 16), _t(2, 64, 2, 16), _t(2, 3, 2, 16), _t(2, 3, 2, 16)
    results = {}
    for direct in (True, False):
        with contextlib.nullcontext() if direct else _ThroughTheOps():
            assert direct_rule(q) == direct
            torch.manual_seed(7)
            out = tileattn.flash_attn_func(q, k, v, dropout_p=0.25, causal=True)
            grads = torch.autograd.grad(out, (q, k, v), dout)
            k_cache, v_cache = kc.clone(), vc.clone()
            version = k_cache._version
            dec = tileattn.flash_attn_with_kvcache(q[:, :3], k_cache, v_cache, kn, vn, cache_seqlens=20, causal=True)
            assert k_cache._version > version
        results[direct] = (out, *grads, dec, k_cache, v_cache)
    for a, b in zip(results[True], results[False]):
        assert torch.equal(a, b)
    assert direct_rule(q, None)
    with torch._subclasses.FakeTensorMode():
        assert not direct_rule(torch.empty(1))


def test_direct_path_edge_cases():
    """The direct eager path keeps what the custom op allowed: varlen under inference mode (no version
    counters), torch.jit.trace (goes through the op), and a double backward that fails loudly instead of
    returning gradients without a graph."""
    from tileattn.backend import direct

    with torch.inference_mode():
        q = torch.randn(9, 2, 16)
        cu = torch.tensor([0, 4, 9], dtype=torch.int32)
        out = tileattn.flash_attn_varlen_func(q, q, q, cu, cu, 5, 5)
        assert out.shape == q.shape

    q = torch.randn(1, 5, 2, 16)
    traced = torch.jit.trace(lambda a: tileattn.flash_attn_func(a, a, a, causal=True), (q,), check_trace=False)
    assert torch.equal(traced(q), tileattn.flash_attn_func(q, q, q, causal=True))
    assert direct(q)

    qg = q.clone().requires_grad_()
    out = tileattn.flash_attn_func(qg, qg, qg)
    (dq,) = torch.autograd.grad(out.sum(), qg, create_graph=True)
    with pytest.raises(RuntimeError, match="does not require grad|once_differentiable"):
        torch.autograd.grad(dq.sum(), qg)


def test_flashmask_opcheck_and_fullgraph():
    """FlashMask calls the same custom op (startend_row_indices is one more input): opcheck, and a compiled
    fullgraph call gives the eager call's output and gradients."""
    from tileattn import masks

    idx = masks.causal_document_mask([5, 8]).to(DEVICE)
    q, k, v = _t(1, 13, 4, 16, grad=True), _t(1, 13, 2, 16, grad=True), _t(1, 13, 2, 16, grad=True)
    args = (q, k, v, None, None, None, 13, 13, 0.25, -1, 0, 0.0, 0.0, False, idx, True)
    torch.library.opcheck(torch.ops.tileattn.fwd.default, args)
    torch._dynamo.reset()

    def f(q, k, v, idx):
        return tileattn.flashmask_attention(q, k, v, idx, causal=True, return_softmax_lse=True)

    out, lse = torch.compile(f, fullgraph=True, backend=BACKEND)(q, k, v, idx)
    ref, ref_lse = f(q, k, v, idx)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads))
