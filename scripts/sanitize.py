"""Every kernel on odd shapes with masked tails, for compute-sanitizer:

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck python scripts/sanitize.py
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool racecheck python scripts/sanitize.py
    (add --kvcache for the KV-cache kernels only, --flashmask for the FlashMask calls only, --fp8 for the
    FP8 calls only, --mla for MLA decoding only, --bad-values for the KV-cache calls with index values
    out of range only, --gluon for the Gluon kernels' builds only, --gluon-fwd / --gluon-bwd for its two
    halves)

Without PyTorch's caching allocator each tensor is its own allocation, so an access one element past a
tensor is reported. Covers the forward, the backward (preprocess, dK/dV, dQ), the varlen scheduling,
with every feature flag and the per-feature tile tables (causal, window, varlen), and the KV-cache
kernels (contiguous and paged caches, split-KV and its combine, leftpad, batch_idx, the table lookahead
and in-loop variants, paged prefill, TMA and 64-bit offset builds, which only settings select here,
through ``configs.override``), with odd head dims and ragged tails; and KV-cache and MLA calls whose
index values are out of range, which the kernels check as they read them (``tileattn.errors``): every
read must stay inside the caches and every append inside its own sequence's row or pages."""

import dataclasses
import sys

import torch

import tileattn
from tileattn.kernels import configs

torch.manual_seed(0)
dev, dt = "cuda", torch.bfloat16
KVCACHE_ONLY = "--kvcache" in sys.argv  # the KV-cache kernels only (a shorter run)


def bad_value_calls() -> None:
    """KV-cache calls with each index value out of range (the kernels check them, the next check raises):
    cache_seqlens negative and past the capacity, cache_leftpad past cache_seqlens, cache_batch_idx
    negative, past the rows and repeated with an append, block-table entries negative and past the pool
    (covering the new token and older keys), rotary tables too short; split and not; the paged varlen
    call's table; MLA lengths and table entries."""
    from tileattn import mla

    def refused(fn, *args, **kwargs) -> None:
        fn(*args, **kwargs)
        try:
            tileattn.check_errors(dev)
        except tileattn.InvalidArgument:
            return
        raise AssertionError("a bad index value was not reported")

    i32 = dict(dtype=torch.int32, device=dev)
    q = torch.randn(3, 2, 8, 72, device=dev, dtype=dt)
    new = torch.randn(3, 2, 2, 72, device=dev, dtype=dt)
    angle = torch.rand(300, 36, device=dev)
    cos, sin = angle.cos().to(dt), angle.sin().to(dt)
    rows = torch.randn(4, 157, 2, 72, device=dev, dtype=dt)
    pool = torch.randn(3 * 10 + 1, 16, 2, 72, device=dev, dtype=dt)
    table = torch.randperm(31, device=dev)[:30].view(3, 10).int()
    ok = torch.tensor([0, 61, 150], **i32)
    for splits in (1, 4):
        for kw in (
            dict(cache_seqlens=torch.tensor([0, -5, 150], **i32)),
            dict(cache_seqlens=torch.tensor([0, 61, 156], **i32)),
            dict(cache_seqlens=ok, cache_leftpad=torch.tensor([0, 90, 3], **i32)),
            dict(cache_seqlens=ok, cache_batch_idx=torch.tensor([0, -1, 2], **i32)),
            dict(cache_seqlens=ok, cache_batch_idx=torch.tensor([0, 4, 2], **i32)),
            dict(cache_seqlens=ok, cache_batch_idx=torch.tensor([1, 1, 2], **i32)),
            dict(cache_seqlens=ok, rotary_cos=cos[:100], rotary_sin=sin[:100]),
        ):
            rotary = {} if "rotary_cos" in kw else dict(rotary_cos=cos, rotary_sin=sin)
            call = dict(causal=True, num_splits=splits, **rotary, **kw)
            refused(tileattn.flash_attn_with_kvcache, q, rows, rows, new, new, **call)
        for column, page in ((3, 31), (0, -1), (2, 2**31 - 1)):  # (the new token of sequence 1 at column 3)
            bad = table.clone()
            bad[1, column] = page
            call = dict(cache_seqlens=ok, block_table=bad, num_splits=splits)
            refused(tileattn.flash_attn_with_kvcache, q, pool, pool, new, new, **call)
    cu = torch.tensor([0, 5, 9], **i32)
    bad = table[:2, :1].clone()
    bad[1, 0] = 77
    qv = torch.randn(9, 8, 72, device=dev, dtype=dt)
    refused(tileattn.flash_attn_varlen_func, qv, pool, pool, cu, cu, 5, 5, block_table=bad)
    latent = torch.randn(9, 16, 1, 80, device=dev, dtype=dt)
    lat_table = torch.arange(8, **i32).view(2, 4)
    ql = torch.randn(2, 1, 16, 80, device=dev, dtype=dt)
    for lens, entry in (([40, 70], None), ([-3, 20], None), ([40, 20], 99)):
        t = lat_table.clone()
        if entry is not None:
            t[1, 1] = entry
        refused(mla.flash_mla_with_kvcache, ql, latent, t, torch.tensor(lens, **i32), 64)


def mla_calls() -> None:
    """MLA decoding: pages of 16, 64 and 256, ragged and empty sequences, speculative tokens past a short
    cache (rows that see nothing), a split-heavy schedule, GQA latents and another value width."""
    from tileattn import mla
    from tileattn.params import MLASettings

    for page, lens, sq, h, hk, d, dv in (
        (64, [300, 1, 0, 129], 1, 16, 1, 576, 512),
        (16, [70, 3, 0], 3, 128, 1, 576, 512),
        (256, [513, 40], 2, 32, 2, 576, 512),
        (16, [37, 90], 2, 8, 1, 176, 128),
    ):
        pages = -(-max(lens) // page)
        kv = torch.randn(len(lens) * pages + 1, page, hk, d, device=dev, dtype=dt)
        table = torch.randperm(len(lens) * pages + 1, device=dev)[: len(lens) * pages].view(len(lens), pages).int()
        q = torch.randn(len(lens), sq, h, d, device=dev, dtype=dt)
        seqlens = torch.tensor(lens, dtype=torch.int32, device=dev)
        for schedule in (None, mla.schedule(seqlens, 7, MLASettings(schedule_block=16))):
            extra = dict(tile_scheduler_metadata=schedule[0], num_splits=schedule[1]) if schedule else {}
            mla.flash_mla_with_kvcache(q, kv, table, seqlens, dv, causal=True, **extra)


def fp8_calls() -> None:
    """FP8: the forward on e4m3 q, k, v (ragged tiles, GQA, causal with seqlen_q != seqlen_k, a window,
    softcap, head dims 40 / 111 / 256, a packed batch with an empty sequence; V read through its
    transposed copy and directly), and FP8 KV caches (contiguous and paged, append, split-KV)."""
    from tileattn import fp8

    def quantized(*shape, nheads_k=None):
        return fp8.quantize(torch.randn(*shape, device=dev, dtype=dt), nheads_k)

    base = configs.for_device(torch.device(dev))
    for settings in (base, dataclasses.replace(base, fp8_v_transposed=False)):
        with configs.override(settings):
            for b, sq, sk, h, hk, d, kw in (
                (2, 113, 301, 4, 2, 40, {"causal": True}),
                (1, 257, 130, 2, 1, 111, {"window_size": (33, 7), "softcap": 5.0}),
                (1, 129, 129, 2, 2, 256, {}),
            ):
                (q, qd), (k, kd), (v, vd) = (
                    quantized(b, sq, h, d, nheads_k=hk),
                    quantized(b, sk, hk, d),
                    quantized(b, sk, hk, d),
                )
                tileattn.flash_attn_func(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, **kw)
            lens = [37, 0, 130]
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
            (q, qd), (k, kd) = (fp8.quantize(torch.randn(167, hh, 72, device=dev), 2, cu) for hh in (4, 2))
            tileattn.flash_attn_varlen_func(
                q, k, k, cu, cu, 130, 130, causal=True, q_descale=qd, k_descale=kd, v_descale=kd
            )
    for page in (None, 16):
        q = torch.randn(3, 2, 8, 72, device=dev, dtype=dt)
        new_k, new_v = (torch.randn(3, 2, 2, 72, device=dev, dtype=dt) for _ in range(2))
        layout = {}
        if page:
            kc = torch.randn(3 * 10, page, 2, 72, device=dev).to(torch.float8_e4m3fn)
            layout["block_table"] = torch.randperm(30, device=dev).view(3, 10).int()
        else:
            kc = torch.randn(3, 157, 2, 72, device=dev).to(torch.float8_e4m3fn)
        vc = kc.clone()
        descale = torch.rand(3, 2, device=dev) + 0.5
        seqlens = torch.tensor([0, 61, 155], dtype=torch.int32, device=dev)
        for splits in (1, 4):
            tileattn.flash_attn_with_kvcache(
                q, kc, vc, new_k, new_v, cache_seqlens=seqlens, causal=True, num_splits=splits,
                k_descale=descale, v_descale=descale, **layout,
            )  # fmt: skip


def _gluon_here() -> bool:
    """Whether the Gluon kernels run here (sm90, Triton 3.6; nothing to run elsewhere)."""
    from tileattn.kernels import gluon

    return torch.cuda.get_device_capability()[0] == 9 and gluon.available()


def gluon_calls() -> None:
    """The Gluon kernels: ``gluon_forward_calls`` and ``gluon_backward_calls``."""
    gluon_forward_calls()
    gluon_backward_calls()


def gluon_forward_calls() -> None:
    """The Gluon forward on ragged tails: key and query lengths that are not tiles, causal with seqlen_q >
    seqlen_k (rows that see no key, work items with no key tile), GQA, both grids (one program per tile;
    persistent with a few programs each walking many items, so the barriers' phases wrap), head dims 64, 96,
    128 and 256, the named-barrier ping-pong and the branch-free mask loops (alone and together), causal
    heads walked in small groups (``l2_bytes``; without the mask loops in snake order too), half the
    exponentials by polynomial (``exp2_poly``, with the ping-pong), and a backward behind it. Packed batches
    (both grids)."""
    from tileattn.params import AttnParams

    if not _gluon_here():
        return
    from tileattn.kernels.gluon import forward as hopper

    for d, block_n in ((64, 128), (96, 128), (128, 128), (256, 64)):
        for sq, sk, causal in ((300, 300, True), (113, 1025, True), (1025, 113, True), (200, 333, False)):
            q = torch.randn(2, sq, 4, d, device=dev, dtype=dt)
            k, v = (torch.randn(2, sk, 2, d, device=dev, dtype=dt) for _ in range(2))
            p = AttnParams(2, sq, sk, d, d**-0.5, window_right=0 if causal else -1)
            for programs in (hopper.ONE_PER_TILE, 3):
                # the named-barrier ping-pong and the branch-free mask loops, alone and together
                # (with the exponentials by polynomial where the ping-pong is on)
                for pingpong, mask_loops in ((False, False), (True, False), (False, True), (True, True)):
                    hopper.attn_fwd(
                        q, k, v, p, block_n=block_n, stages=2 if d == 256 else 3, programs=programs,
                        pingpong=pingpong, mask_loops=mask_loops, l2_bytes=100_000, snake=not mask_loops,
                        exp2_poly=4 if pingpong else 0,
                    )  # fmt: skip
        q, k, v = (torch.randn(1, 257, 4, d, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
        out = tileattn.flash_attn_func(q, k, v, causal=True)
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        # a packed batch (empty sequences, one row, no key; blocks past a short sequence skipped), both grids
        lens_q, lens_k = [37, 0, 1, 130, 300], [5, 9, 0, 200, 300]
        cu_q, cu_k = (
            torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
            for lens in (lens_q, lens_k)
        )
        q = torch.randn(1, sum(lens_q), 4, d, device=dev, dtype=dt)
        k, v = (torch.randn(1, sum(lens_k), 2, d, device=dev, dtype=dt) for _ in range(2))
        for causal in (True, False):
            p = AttnParams(
                5, 300, 300, d, d**-0.5, window_right=0 if causal else -1, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k
            )
            for programs in (hopper.ONE_PER_TILE, 3):
                hopper.attn_fwd(q, k, v, p, block_n=block_n, programs=programs)


def gluon_backward_calls() -> None:
    """Sliding windows and head-major layouts through the public call (forward and backward). The Gluon
    backward alone at its head dims: ragged tails, rows that see no key, GQA and MQA, dQ by TMA reduce-adds
    and by atomics, dK after dQ (``dq_first``), dropout, and packed batches (empty sequences, one row, no
    key)."""
    from tileattn.params import AttnParams

    if not _gluon_here():
        return
    # sliding windows (each side, both, the diagonal alone) and head-major q, k and dO (Hugging Face's
    # layout after rotary), forward and backward through the public call (the Gluon kernels at their
    # head dims)
    for d in (64, 128, 256):
        for window in ((100, 50), (-1, 17), (64, -1), (0, 0)):
            q = torch.randn(2, 300, 4, d, device=dev, dtype=dt, requires_grad=True)
            k, v = (torch.randn(2, 257, 2, d, device=dev, dtype=dt, requires_grad=True) for _ in range(2))
            out = tileattn.flash_attn_func(q, k, v, window_size=window)
            torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        q = torch.randn(2, 4, 300, d, device=dev, dtype=dt).transpose(1, 2).requires_grad_()
        k = torch.randn(2, 2, 300, d, device=dev, dtype=dt).transpose(1, 2).requires_grad_()
        v = torch.randn(2, 300, 2, d, device=dev, dtype=dt, requires_grad=True)
        out = tileattn.flash_attn_func(q, k, v, causal=True)
        torch.autograd.grad(out, (q, k, v), torch.randn(2, 4, 300, d, device=dev, dtype=dt).transpose(1, 2))
    from tileattn.kernels import backward as portable
    from tileattn.kernels import forward
    from tileattn.kernels.gluon import backward as hopper_bwd

    # the Gluon backward alone: ragged tails, rows that see no key, GQA and MQA, seqlen_q not a multiple
    # of 4 (padded LSE/Δ rows), dQ by TMA reduce-adds and by atomics, dropout
    for d in hopper_bwd.HEAD_DIMS:
        for sq, sk, hk, causal in ((113, 1025, 2, True), (1025, 113, 1, True), (63, 63, 4, False), (1, 7, 2, False)):
            q, do = (torch.randn(2, sq, 4, d, device=dev, dtype=dt) for _ in range(2))
            k, v = (torch.randn(2, sk, hk, d, device=dev, dtype=dt) for _ in range(2))
            p = AttnParams(2, sq, sk, d, d**-0.5, window_right=0 if causal else -1)
            settings = configs.current(torch.device(dev))
            out, lse = forward.attn_fwd(q, k, v, p, settings)
            delta = portable.delta(out, do, lse, p, settings)
            for dq_tma in (True, False):
                hopper_bwd.attn_bwd(do, q, k, v, lse, delta, p, dq_tma=dq_tma)
            if d in hopper_bwd.SPLIT_HEAD_DIMS:  # the split build's dQ chunks of 32 on a ring of 2, first chunk early
                hopper_bwd.attn_bwd(do, q, k, v, lse, delta, p, stages=2, dq_chunk=32, dq_first=True)
            else:  # dK after dQ (dQ's add under it)
                hopper_bwd.attn_bwd(do, q, k, v, lse, delta, p, dq_first=True)
            # dropout: the draws' shared-memory exchange (query tiles of 64 rows, and of 128 at head dim 64)
            p.dropout_p, p.philox_seed = 0.125, 0x5EED
            for block_m in (64, 128) if d == 64 else (64,):
                hopper_bwd.attn_bwd(do, q, k, v, lse, delta, p, block_m=block_m)
        # a packed batch (its LSE/Δ rows moved to aligned starts), through the public call
        lens_q, lens_k = [37, 0, 1, 130, 300], [5, 9, 0, 200, 300]
        cu_q, cu_k = (
            torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
            for lens in (lens_q, lens_k)
        )
        q = torch.randn(sum(lens_q), 4, d, device=dev, dtype=dt, requires_grad=True)
        k, v = (torch.randn(sum(lens_k), 2, d, device=dev, dtype=dt, requires_grad=True) for _ in range(2))
        for causal in (True, False):
            out = tileattn.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal)
            torch.autograd.grad(out, (q, k, v), torch.randn_like(out))


def flashmask_calls() -> None:
    """FlashMask: builders and random per-head bounds on odd shapes (ragged tiles, GQA, seqlen_q != seqlen_k,
    head dims 59 / 111 / 256, dropout, the deterministic backward, a packed batch with empty sequences)."""
    from tileattn import masks

    def run(b, sq, sk, h, hk, d, idx, **kw):
        q = torch.randn(b, sq, h, d, device=dev, dtype=dt, requires_grad=True)
        k = torch.randn(b, sk, hk, d, device=dev, dtype=dt, requires_grad=True)
        v = torch.randn(b, sk, hk, d, device=dev, dtype=dt, requires_grad=True)
        out = tileattn.flashmask_attention(q, k, v, idx.to(dev), **kw)
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))

    run(2, 301, 301, 4, 2, 59, torch.cat([masks.causal_document_mask([100, 1, 200])] * 2), causal=True)
    run(1, 257, 257, 2, 1, 111, masks.global_sliding_window_mask(257, 5, 40), dropout_p=0.2)
    run(1, 203, 203, 2, 2, 256, masks.prefix_lm_document_mask([70, 133], [30, 0]), deterministic=True)
    run(1, 130, 130, 2, 2, 128, masks.causal_blockwise_mask([30, 40, 60]), causal=True)
    bounds = torch.randint(0, 90, (2, 3, 150, 2), dtype=torch.int32).sort(-1).values  # C = 2, per head
    run(2, 90, 150, 3, 1, 64, bounds.int(), causal=True)
    lens = [37, 0, 1, 130]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    idx = torch.cat([masks.document_mask([n])[0, 0] if n else torch.zeros(0, 2, dtype=torch.int32) for n in lens])
    q = torch.randn(sum(lens), 4, 72, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(sum(lens), 2, 72, device=dev, dtype=dt, requires_grad=True)
    out = tileattn.flashmask_varlen_attention(q, k, k, cu, cu, 130, 130, idx[None].to(dev))
    torch.autograd.grad(out, (q, k), torch.randn_like(out))


ALONE = {  # flags that run one workload alone
    "--gluon": gluon_calls,
    "--gluon-fwd": gluon_forward_calls,  # (each half of --gluon fits a device call under memcheck)
    "--gluon-bwd": gluon_backward_calls,
    "--bad-values": bad_value_calls,
    "--mla": mla_calls,
    "--fp8": fp8_calls,
    "--flashmask": flashmask_calls,
}
for flag, calls in ALONE.items():
    if flag in sys.argv:
        calls()
        torch.cuda.synchronize()
        print("sanitize workload done")
        sys.exit(0)
if not KVCACHE_ONLY:
    gluon_calls()
    flashmask_calls()
    fp8_calls()
    mla_calls()
    CASES = [
        (1, 113, 203, 4, 2, 59, dict(causal=True)),
        (2, 203, 113, 3, 1, 111, dict(window_size=(17, 5), softcap=3.0)),
        (1, 63, 63, 2, 2, 256, dict(dropout_p=0.2, causal=True)),
        (2, 1, 77, 4, 4, 40, dict(alibi_slopes=torch.rand(2, 4, device=dev))),
        (1, 129, 65, 2, 1, 96, dict(causal=True)),  # first 64 rows see no key
        (2, 257, 301, 4, 2, 128, dict(causal=True)),  # dQ by TMA reduce-adds from the dK/dV pass
        (2, 257, 301, 4, 2, 128, dict(causal=True, deterministic=True)),  # the two-pass backward
        (2, 203, 331, 4, 2, 64, dict(window_size=(70, 9))),  # head dim 64's window tiles
    ]
    for b, sq, sk, h, hk, d, kw in CASES:
        q = torch.randn(b, sq, h, d, device=dev, dtype=dt, requires_grad=True)
        k = torch.randn(b, sk, hk, d, device=dev, dtype=dt, requires_grad=True)
        v = torch.randn(b, sk, hk, d, device=dev, dtype=dt, requires_grad=True)
        out = tileattn.flash_attn_func(q, k, v, **kw)
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    lens_q, lens_k = [37, 0, 1, 130], [5, 9, 0, 200]
    q = torch.randn(sum(lens_q), 4, 72, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(sum(lens_k), 2, 72, device=dev, dtype=dt, requires_grad=True)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    for kw in (dict(causal=True), dict(window_size=(3, 9), dropout_p=0.1)):
        out = tileattn.flash_attn_varlen_func(q, k, k, cu_q, cu_k, max(lens_q), max(lens_k), **kw)
        torch.autograd.grad(out, (q, k), torch.randn_like(out))
    # head dim 256's varlen dK/dV tiles (32 keys), with empty and length-1 sequences
    q = torch.randn(sum(lens_q), 4, 256, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(sum(lens_k), 2, 256, device=dev, dtype=dt, requires_grad=True)
    for kw in (dict(causal=True), dict()):
        out = tileattn.flash_attn_varlen_func(q, k, k, cu_q, cu_k, max(lens_q), max(lens_k), **kw)
        torch.autograd.grad(out, (q, k), torch.randn_like(out))

# KV cache: odd head dims, capacities that are not multiples of the tile, empty and full caches.
for d, page, kw in ((59, None, dict(causal=True)), (96, 16, dict(window_size=(7, 0))), (40, 5, dict(softcap=2.0))):
    b, hk, h, cap = 3, 2, 6, 301
    q = torch.randn(b, 3, h, d, device=dev, dtype=dt)
    if page:
        pages = -(-cap // page)
        kc = torch.randn(b * pages + 1, page, hk, d, device=dev, dtype=dt)
        table = torch.randperm(b * pages + 1, device=dev)[: b * pages].view(b, pages).int()
        extra = dict(block_table=table, cache_leftpad=torch.tensor([0, 7, 100], dtype=torch.int32, device=dev))
    else:
        kc = torch.randn(b + 1, cap, hk, d, device=dev, dtype=dt)
        extra = dict(cache_batch_idx=torch.tensor([3, 0, 1], dtype=torch.int32, device=dev))
    vc = torch.randn_like(kc)
    new = torch.randn(b, 3, hk, d, device=dev, dtype=dt)
    seqlens = torch.tensor([0, 150, cap - 3], dtype=torch.int32, device=dev)
    angle = torch.rand(cap + 3, 8, device=dev)
    for splits in (1, 4, 0, 4):  # the repeated signature relaunches its planned builds (launch.Bound)
        tileattn.flash_attn_with_kvcache(
            q, kc, vc, new, new, angle.cos().to(dt), angle.sin().to(dt), seqlens, num_splits=splits, **extra, **kw
        )
    if page:
        lens_q, lens_k = [3, 0, 9], [40, 7, 290]
        qv = torch.randn(sum(lens_q), h, d, device=dev, dtype=dt)
        cq = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        ck = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        tileattn.flash_attn_varlen_func(qv, kc, vc, cq, ck, 9, 290, causal=True, block_table=table)
# the paged kernel's in-loop table variant runs at full occupancy: a batch of many sequences
kc = torch.randn(64 * 8, 16, 2, 64, device=dev, dtype=dt)
table = torch.randperm(64 * 8, device=dev).view(64, 8).int()
q = torch.randn(64, 1, 8, 64, device=dev, dtype=dt)
tileattn.flash_attn_with_kvcache(
    q, kc, kc, cache_seqlens=torch.randint(0, 129, (64,), dtype=torch.int32, device=dev), block_table=table
)


def with_decode(**changes) -> configs.Settings:
    """The GPU's settings with these DecodeSettings fields changed (builds the defaults do not select)."""
    s = configs.current(torch.device(dev))
    return dataclasses.replace(s, decode=dataclasses.replace(s.decode, **changes))


# TMA reads of long programs (DecodeSettings.tma_tiles): a contiguous cache with cache_batch_idx and pages
# of 256 (their tiles lie in one page), sequences of odd lengths whose last tiles are masked
q = torch.randn(3, 1, 8, 64, device=dev, dtype=dt)
lens = torch.tensor([4001, 2100, 3333], dtype=torch.int32, device=dev)
kc = torch.randn(4, 4096, 2, 64, device=dev, dtype=dt)
with configs.override(with_decode(tma=True)):
    for splits in (1, 2):
        tileattn.flash_attn_with_kvcache(
            q,
            kc,
            kc,
            cache_seqlens=lens,
            cache_batch_idx=torch.tensor([3, 0, 1], dtype=torch.int32, device=dev),
            num_splits=splits,
        )
kc = torch.randn(3 * 16 + 1, 256, 2, 64, device=dev, dtype=dt)
table = torch.randperm(3 * 16 + 1, device=dev)[: 3 * 16].view(3, 16).int()
with configs.override(with_decode(paged_tma=True)):
    for splits in (1, 2):
        tileattn.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=lens, block_table=table, num_splits=splits)
# 64-bit offsets (pools past 2**31 elements take them; forced here): pages of 256 (one lookup per tile), of
# 16 and of 5 with cache_leftpad (lookups per row), v_cache with other strides than k_cache's
with configs.override(with_decode(offs_64_always=True)):
    for page in (256, 16, 5):
        pages = -(-4096 // page)
        kc = torch.randn(3 * pages + 1, page, 2, 64, device=dev, dtype=dt)
        vc = torch.randn(3 * pages + 1, page, 2, 72, device=dev, dtype=dt)[..., :64]
        table = torch.randperm(3 * pages + 1, device=dev)[: 3 * pages].view(3, pages).int()
        extra = dict(cache_leftpad=torch.tensor([0, 9, 1000], dtype=torch.int32, device=dev)) if page == 5 else {}
        for splits in (1, 2):
            tileattn.flash_attn_with_kvcache(
                q, kc, vc, cache_seqlens=lens, block_table=table, num_splits=splits, **extra
            )
bad_value_calls()
torch.cuda.synchronize()
print("sanitize workload done")
