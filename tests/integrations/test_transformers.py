"""Hugging Face transformers on tileattn, two ways: attn_implementation="tileattn" (our registration) and
"flash_attention_2" through the flash_attn shim (transformers' own FlashAttention code calling tileattn).
Logits and gradients of small, randomly initialised models match the "eager" implementation within the
tolerance rule, for padded batches (run as varlen), packed sequences (position_ids restarting at 0, or a
flattening data collator's cu_seq_lens) and cached generation.

transformers enables flash_attention_2 only where CUDA is available; without a GPU these tests tell it
that CUDA is available while the tensors stay on the CPU (tileattn's CPU path), so that the code that
transformers runs on a GPU runs here too. In bf16, as FlashAttention is run (transformers' fp32 path looks
for nn.Linear layers, which GPT-2 does not have)."""

import contextlib
import importlib.util
import inspect
import subprocess
import sys
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers")
import tileattn.integrations.transformers  # noqa: E402,F401  (registers "tileattn")
from tileattn import bert_padding, shim  # noqa: E402
from tileattn.testing import check_close  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REF_DTYPE = torch.float64
IMPLS = ["tileattn", "flash_attention_2"]
# transformers caches the flash functions it imported in these globals of modeling_flash_attention_utils
_LOADED = (
    "_loaded_implementation",
    "_flash_fn",
    "_flash_varlen_fn",
    "_flash_with_kvcache_fn",
    "_pad_fn",
    "_unpad_fn",
    "_process_flash_kwargs_fn",
    "_process_with_kvcache_kwargs_fn",
)


def _flash_attn_distributions(iu) -> list[str]:
    """The distributions transformers maps the top-level package flash_attn to (a cached function in
    newer releases, a dict read at import in older ones)."""
    mapping = (
        iu._package_distribution_mapping()
        if hasattr(iu, "_package_distribution_mapping")
        else iu.PACKAGE_DISTRIBUTION_MAPPING
    )
    return mapping.get("flash_attn", [])


def _dtype(impl: str, name: str = "") -> torch.dtype:
    """bf16 as FlashAttention is run (gpt-oss, its sinks included, in bf16 on the CPU path as well); the CPU
    path's fp32 otherwise."""
    return torch.bfloat16 if DEVICE == "cuda" or impl == "flash_attention_2" or name == "gpt-oss" else torch.float32


def _decoder(impl: str, name: str):
    """The decoder ``name``'s config; transformers takes gpt-oss to FlashAttention-2's path never (flash_attn 2
    has no sinks: it sends the name to a hub kernel instead), so only tileattn runs it."""
    if impl == "flash_attention_2" and name == "gpt-oss":
        pytest.skip("transformers runs gpt-oss on FlashAttention-3/4 kernels only, never flash_attention_2")
    return _decoder_configs()[name]


@contextlib.contextmanager
def flash_attention_2_via_shim():
    """transformers with tileattn.shim installed (and CUDA reported available on a machine without it);
    everything is put back afterwards: sys.modules, transformers' caches, the flash functions it loaded."""
    import transformers.modeling_flash_attention_utils as mfu
    from transformers.utils import import_utils

    saved = {n: sys.modules.pop(n) for n in list(sys.modules) if n.split(".")[0] == "flash_attn"}
    with pytest.MonkeyPatch.context() as mp:
        for attr in _LOADED:  # (the names differ between transformers releases)
            if hasattr(mfu, attr):
                mp.setattr(mfu, attr, None)
        if not torch.cuda.is_available():
            mp.setattr(torch.cuda, "is_available", lambda: True)
        import_utils.is_torch_cuda_available.cache_clear()
        shim.install()
        try:
            yield
        finally:
            shim.uninstall()
    import_utils.is_torch_cuda_available.cache_clear()
    sys.modules.update(saved)


@pytest.fixture(params=IMPLS)
def impl(request):
    if request.param == "flash_attention_2":
        with flash_attention_2_via_shim():
            yield request.param
    else:
        yield request.param


def _decoder_configs():
    from transformers import GPT2Config, GptOssConfig, LlamaConfig, Qwen2Config

    small = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    return {
        "llama-gqa": LlamaConfig(num_key_value_heads=2, **small),
        "qwen2-gqa": Qwen2Config(num_key_value_heads=2, **small),
        "gpt2": GPT2Config(vocab_size=97, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0),
        # attention sinks (s_aux), a sliding and a full layer, GQA, experts routed to every token
        "gpt-oss": GptOssConfig(
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"],
            num_local_experts=2,
            num_experts_per_tok=2,
            **small,
        ),
    }


DECODERS = ["llama-gqa", "qwen2-gqa", "gpt2", "gpt-oss"]


def _model(cfg, impl, dtype, auto=None):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cls = auto or AutoModelForCausalLM
    experts = {"experts_implementation": "eager"} if cfg.model_type == "gpt_oss" else {}  # (grouped_mm: no fp64)
    model = cls.from_config(cfg, attn_implementation=impl, **experts)
    sinks = [m.sinks for m in model.modules() if isinstance(getattr(m, "sinks", None), torch.nn.Parameter)]
    gen = torch.Generator().manual_seed(1)
    for sink in sinks:  # (gpt-oss's sink logits as a trained model has them, N(0, 2), not its zeros)
        with torch.no_grad():
            sink.copy_(torch.randn(sink.shape, generator=gen) * 2)
    model = model.to(DEVICE, dtype).eval()
    assert model.config._attn_implementation == impl
    return model


def _loss(logits, mask):
    return (logits.float().square() * mask[..., None]).mean()


def _grads(model, loss):
    return torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])


def _check_grads(name, grads, ref_grads, lowp_grads):
    """Parameter gradients: the tolerance rule per tensor, the floor scaled by the largest reference
    gradient."""
    scale = torch.stack([g.abs().max() for g in ref_grads])
    for i, (g, r, lg) in enumerate(zip(grads, ref_grads, lowp_grads)):
        check_close(f"{name} grad {i}", g, r, lg, floor_scale=scale)


def _eager_rows(model, ids, mask, position_ids):
    """Logits ``(batch, seqlen, vocab)`` of the eager model run on each row's real tokens alone, at their
    positions in ``position_ids`` (0 at padded positions, which are not compared). The eager model on the
    padded batch is no reference: in float64 its fully masked padding rows turn NaN, which reaches the
    row's real tokens through the next layer's zero weights (0 · NaN)."""
    rows = []
    for b in range(ids.shape[0]):
        real = mask[b].bool()
        logits = model(ids[b, real][None], position_ids=position_ids[b, real][None]).logits[0]
        rows.append(logits.new_zeros(ids.shape[1], logits.shape[-1]).index_put((real.nonzero()[:, 0],), logits))
    return torch.stack(rows)


@pytest.mark.parametrize("name", DECODERS)
def test_decoder_padded_batch_matches_eager(impl, name):
    """Forward and backward of a batch with a left-padded and a right-padded row."""
    cfg = _decoder(impl, name)
    dtype = _dtype(impl, name)
    ids = torch.randint(0, 97, (3, 13), device=DEVICE)
    mask = torch.ones(3, 13, dtype=torch.long, device=DEVICE)
    mask[1, :4] = 0  # left padding
    mask[2, 9:] = 0  # right padding
    results = {}
    positions = torch.arange(13, device=DEVICE).expand(3, 13)  # (the padded call's: its token indices)
    for run_impl, run_dtype in ((impl, dtype), ("eager", dtype), ("eager", REF_DTYPE)):
        model = _model(cfg, run_impl, run_dtype)
        if run_impl == "eager":
            logits = _eager_rows(model, ids, mask, positions)
        else:
            logits = model(ids, attention_mask=mask).logits
        results[(run_impl, run_dtype)] = (logits, _grads(model, _loss(logits, mask)))
    real = mask.bool()
    out, grads = results[(impl, dtype)]
    lowp, lowp_grads = results[("eager", dtype)]
    ref, ref_grads = results[("eager", REF_DTYPE)]
    check_close(f"{name} logits", out[real], ref[real], lowp[real])
    _check_grads(name, grads, ref_grads, lowp_grads)


def _flattened_batch(lengths):
    """A flattening data collator's batch of sequences of ``lengths`` (one row, position_ids restarting
    at 0, cu_seq_lens and max_length kwargs), and the sequences."""
    from transformers import DataCollatorWithFlattening

    seqs = [torch.randint(0, 97, (n,)).tolist() for n in lengths]
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=True)(
        [{"input_ids": s} for s in seqs]
    )
    batch.pop("labels")
    batch = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    assert batch["cu_seq_lens_q"].tolist() == torch.tensor([0, *lengths]).cumsum(0).tolist()
    return batch, seqs


@pytest.mark.parametrize("name", DECODERS)
@pytest.mark.parametrize("packing", ["collator", "position_ids"])
def test_packed_sequences_match_separate_runs(impl, name, packing):
    """One row holding three sequences equals the three run alone: logits, and the gradients of a loss
    summed over the tokens. ``collator``: DataCollatorWithFlattening's cu_seq_lens/max_length kwargs;
    ``position_ids``: only position_ids restarting at 0 (transformers derives the sequences from them when
    the forward has no cache, as in training; with one, eager attention sees one sequence per row)."""
    cfg = _decoder(impl, name)
    dtype = _dtype(impl, name)
    if name == "gpt-oss" and packing == "position_ids":
        pytest.skip("transformers' gpt-oss does not split documents by position_ids (eager attends across them too)")
    lengths = [5, 9, 4]
    batch, seqs = _flattened_batch(lengths)
    if packing == "position_ids":
        batch = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
    model = _model(cfg, impl, dtype)
    packed = model(**batch).logits[0]
    grads = _grads(model, packed.float().square().sum() / packed.numel())
    pieces = {}
    for run_dtype in (dtype, REF_DTYPE):
        eager = _model(cfg, "eager", run_dtype)
        logits = [eager(torch.tensor([s], device=DEVICE)).logits[0] for s in seqs]
        loss = sum(lg.float().square().sum() for lg in logits) / packed.numel()
        pieces[run_dtype] = (torch.cat(logits), _grads(eager, loss))
    (lowp, lowp_grads), (ref, ref_grads) = pieces[dtype], pieces[REF_DTYPE]
    start = 0
    for n in lengths:
        piece = slice(start, start + n)
        check_close(f"{name} packed [{start}:{start + n}]", packed[piece], ref[piece], lowp[piece])
        start += n
    _check_grads(f"{name} packed", grads, ref_grads, lowp_grads)


@pytest.mark.parametrize("name", DECODERS)
def test_cached_generation_matches_eager(impl, name):
    """Greedy generation with a KV cache (one query against the cache per step, left-padded prompt):
    the scores of every step equal an uncached eager forward over the generated sequence."""
    cfg = _decoder(impl, name)
    dtype = _dtype(impl, name)
    ids = torch.randint(3, 97, (2, 7), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    gen = _model(cfg, impl, dtype).generate(
        ids,
        attention_mask=mask,
        max_new_tokens=6,
        min_new_tokens=6,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    seq = gen.sequences
    full_mask = torch.cat([mask, torch.ones(2, seq.shape[1] - 7, dtype=mask.dtype, device=DEVICE)], 1)
    scores = torch.stack(gen.logits, 1)  # (batch, steps, vocab): raw logits predicting tokens 7..12
    position_ids = (full_mask.cumsum(-1) - 1).clamp(min=0)
    ref = _eager_rows(_model(cfg, "eager", REF_DTYPE), seq, full_mask, position_ids)
    lowp = _eager_rows(_model(cfg, "eager", dtype), seq, full_mask, position_ids)
    steps = slice(6, seq.shape[1] - 1)
    check_close(f"{name} cached generation scores", scores, ref[:, steps], lowp[:, steps])


def test_bert_encoder_padded_batch_matches_eager(impl):
    from transformers import AutoModel, BertConfig

    cfg = BertConfig(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    dtype = _dtype(impl)
    ids = torch.randint(0, 97, (3, 11), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    mask[2, 2:] = 0
    out = _model(cfg, impl, dtype, AutoModel)(ids, attention_mask=mask).last_hidden_state
    ref = _model(cfg, "eager", REF_DTYPE, AutoModel)(ids, attention_mask=mask).last_hidden_state
    lowp = _model(cfg, "eager", dtype, AutoModel)(ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    check_close("bert hidden states", out[real], ref[real], lowp[real])


def test_flashmask_through_model_kwargs():
    """A FlashMask passed to the model's forward (``startend_row_indices``) reaches every attention layer:
    two rows of packed documents on "tileattn" match eager with the same mask as a 4-D additive mask."""
    import oracle
    from tileattn import masks

    cfg = _decoder_configs()["llama-gqa"]
    dtype = _dtype("tileattn")
    ids = torch.randint(0, 97, (2, 13), device=DEVICE)
    idx = torch.cat([masks.causal_document_mask([5, 8]), masks.causal_document_mask([1, 7, 5])]).to(DEVICE)
    seen = oracle.flashmask_visible(idx.cpu(), True, 13) & torch.ones(13, 13, dtype=torch.bool).tril()
    results = {}
    for run_impl, run_dtype in (("tileattn", dtype), ("eager", dtype), ("eager", REF_DTYPE)):
        model = _model(cfg, run_impl, run_dtype)
        if run_impl == "tileattn":
            logits = model(ids, startend_row_indices=idx).logits
        else:
            additive = torch.zeros(seen.shape, dtype=run_dtype).masked_fill(~seen, torch.finfo(run_dtype).min)
            logits = model(ids, attention_mask=additive.to(DEVICE)).logits
        ones = torch.ones(ids.shape, device=DEVICE)
        results[run_dtype if run_impl == "eager" else "tileattn"] = (logits, _grads(model, _loss(logits, ones)))
    (out, grads), (lowp, lowp_grads), (ref, ref_grads) = results["tileattn"], results[dtype], results[REF_DTYPE]
    check_close("flashmask logits", out, ref, lowp)
    _check_grads("flashmask", grads, ref_grads, lowp_grads)


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_custom_4d_mask_matches_eager(kind):
    """A 4-D mask passed to the model (here: two documents per row and a hidden key), boolean (True:
    visible, as SDPA reads it) or additive, runs as a FlashMask and matches eager attention with the same
    mask (additive: eager adds a boolean mask to the scores)."""
    cfg = _decoder_configs()["llama-gqa"]
    ids = torch.randint(0, 97, (2, 11), device=DEVICE)
    seen = torch.ones(11, 11, dtype=torch.bool).tril().repeat(2, 1, 1, 1)
    seen[0, :, 6:, :6] = False  # row 0: documents [0, 6) and [6, 11)
    seen[1, :, :, 3] = False  # row 1: key 3 hidden from every query
    seen[1, :, 3, 3] = True  # (but query 3 sees itself)
    results, dtype = {}, _dtype("tileattn")  # (the baseline: eager in the dtype tileattn runs in)
    for run_impl, run_dtype in (("tileattn", dtype), ("eager", dtype), ("eager", REF_DTYPE)):
        additive = torch.zeros(seen.shape, dtype=run_dtype).masked_fill(~seen, -torch.inf)
        mask = seen if kind == "bool" and run_impl == "tileattn" else additive
        logits = _model(cfg, run_impl, run_dtype)(ids, attention_mask=mask.to(DEVICE)).logits
        results[run_impl, run_dtype] = logits
    out, lowp, ref = results["tileattn", dtype], results["eager", dtype], results["eager", REF_DTYPE]
    check_close(f"4-D {kind} mask logits", out, ref, lowp)


def test_additive_bias_is_refused():
    from tileattn.integrations.transformers import Unsupported

    cfg = _decoder_configs()["llama-gqa"]
    bias = torch.randn(1, 1, 5, 5)
    with pytest.raises(Unsupported, match="additive attention bias"):
        _model(cfg, "tileattn", torch.float32)(torch.randint(0, 97, (1, 5), device=DEVICE), attention_mask=bias)


@pytest.mark.parametrize(
    "keyword, value, words",
    [
        ("position_bias", torch.zeros(1, 2, 3, 3), "position_bias= .*additive attention bias"),
        ("sinks", torch.zeros(1, 2, 3, 1), "sinks= .*sinks per query token"),
        ("indices", torch.zeros(1, 3, 2, dtype=torch.int32), "indices= .*sparse attention"),
        ("my_bias", torch.zeros(3), "my_bias= .*a keyword tileattn does not know"),
        ("output_attentions", True, "output_attentions=True"),
    ],
)
def test_keywords_that_change_the_attention_are_refused(keyword, value, words):
    """A keyword that tileattn does not apply is refused by name; harmless ones and unset ones pass."""
    from tileattn.integrations.transformers import Unsupported, tileattn_attention_forward

    module = torch.nn.Linear(1, 1)
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(Unsupported, match=words):
        tileattn_attention_forward(module, q, q, q, None, **{keyword: value})
    harmless = {"output_attentions": False, "position_ids": torch.arange(3)[None], keyword: None}
    out, _ = tileattn_attention_forward(module, q, q, q, None, **harmless)
    assert out.shape == (1, 3, 2, 8)


def test_mask_used_outside_the_attention_is_refused():
    """The mask of attn_implementation="tileattn" is no tensor: code that uses it as one (a model's own
    attention code) gets a clear error, not a silently different mask."""
    from transformers.masking_utils import causal_mask_function

    from tileattn.integrations.transformers import Unsupported, tileattn_mask

    mask = tileattn_mask(2, 5, 5, mask_function=causal_mask_function, attention_mask=torch.ones(2, 5, dtype=torch.bool))
    scores = torch.zeros(2, 1, 5, 5)
    for use in (
        lambda: scores + mask,
        lambda: mask[:, :, :, :3],
        lambda: mask.dtype,
        lambda: torch.where(torch.ones(5, dtype=torch.bool), mask, 0),
        lambda: bool(mask),
    ):
        with pytest.raises(Unsupported, match="outside tileattn's attention function"):
            use()


def test_models_with_their_own_attention_code_are_refused_when_created():
    from transformers import AutoModelForCausalLM, BloomConfig

    from tileattn.integrations.transformers import Unsupported

    cfg = BloomConfig(vocab_size=97, hidden_size=32, n_layer=1, n_head=4)
    with pytest.raises(Unsupported, match="BloomForCausalLM computes attention with its own code"):
        AutoModelForCausalLM.from_config(cfg, attn_implementation="tileattn")
    AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")  # (others are untouched)


def _runs_oracle(seen: torch.Tensor) -> torch.Tensor:
    """The FlashMask (C = 4) of a visibility mask, column by column: the first run of hidden rows as the
    upper interval, the second as the lower one."""
    batch, heads, seqlen_q, seqlen_k = seen.shape
    idx = torch.zeros(batch, heads, seqlen_k, 4, dtype=torch.int32)
    for b in range(batch):
        for h in range(heads):
            for j in range(seqlen_k):
                hidden = (~seen[b, h, :, j]).tolist() + [False]
                runs, start = [], None
                for i, x in enumerate(hidden):
                    if x and start is None:
                        start = i
                    elif not x and start is not None:
                        runs.append((start, i))
                        start = None
                assert len(runs) <= 2
                upper = runs[0] if runs else (0, 0)
                lower = runs[1] if len(runs) > 1 else (seqlen_q, seqlen_q)
                idx[b, h, j] = torch.tensor([*lower, *upper])
    return idx


@pytest.mark.parametrize("rows_per_block", [1, 3, 64])
def test_masks_become_flashmasks(rows_per_block, monkeypatch):
    """Visibility masks with at most two runs of hidden rows per key column become the FlashMask that
    hides exactly them, whatever the blocks of rows they are read in; a third run is refused."""
    import oracle
    from tileattn.integrations import hf_mask as hf

    g = torch.Generator().manual_seed(0)
    seqlen_q, seqlen_k = 13, 9
    i = torch.arange(seqlen_q)[:, None]
    a = torch.randint(0, seqlen_q + 1, (2, 3, 1, seqlen_k), generator=g)
    b = torch.randint(0, seqlen_q + 1, (2, 3, 1, seqlen_k), generator=g)
    c = torch.randint(0, seqlen_q + 1, (2, 3, 1, seqlen_k), generator=g)
    lo, mid, hi = torch.sort(torch.stack([a, b, c]), 0).values
    seen = ~(((i >= lo) & (i < mid)) | (i >= hi))  # hidden: [lo, mid) and [hi, seqlen_q)
    blocks = (seen[:, :, s : s + rows_per_block] for s in range(0, seqlen_q, rows_per_block))
    idx = hf._column_runs(blocks, seen.shape, torch.device("cpu"))
    assert torch.equal(idx, _runs_oracle(seen))
    assert torch.equal(oracle.flashmask_visible(idx, False, seqlen_q), seen)
    three = seen.clone()
    three[0, 0, :, 0] = torch.tensor([0, 1, 0, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1], dtype=torch.bool)
    blocks = (three[:, :, s : s + rows_per_block] for s in range(0, seqlen_q, rows_per_block))
    with pytest.raises(hf.Unsupported, match="more than two runs"):
        hf._column_runs(blocks, three.shape, torch.device("cpu"))


def test_static_cache_decode_step_compiles_in_one_graph():
    """The decode step with a static cache and a left-padded batch traces as one graph
    (``torch.compile(fullgraph=True)``; the eager backend, as inductor's C++ build is slow on CPU): no host
    read, no data-dependent shape (flash_attn_with_kvcache with cache_seqlens and cache_leftpad). Its
    logits match an eager forward over the same tokens."""
    from transformers import StaticCache

    cfg = _decoder_configs()["llama-gqa"]
    ids = torch.randint(3, 97, (2, 6), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    dtype = _dtype("tileattn")  # (on the GPU bf16: the kernels' dtypes, and the baseline's below)
    model = _model(cfg, "tileattn", dtype)
    cache = StaticCache(config=model.config, max_cache_len=10)
    step = torch.compile(model.forward, backend="eager", fullgraph=True)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    # (the cache's keyword: ``cache`` in newer transformers, ``past_key_values`` before, as 5.17 names it)
    kw = {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values": cache}
    with torch.no_grad():
        token = model(ids, attention_mask=mask, position_ids=positions, **kw).logits[:, -1:].argmax(-1)
        seq, scores = torch.cat([ids, token], 1), []
        for _ in range(2):
            mask = torch.cat([mask, torch.ones_like(token)], 1)
            logits = step(token, attention_mask=mask, position_ids=positions[:, -1:] + 1, **kw).logits
            positions = torch.cat([positions, positions[:, -1:] + 1], 1)
            scores.append(logits[:, -1])
            token = logits[:, -1:].argmax(-1)
            seq = torch.cat([seq, token], 1)
    scores = torch.stack(scores, 1)
    refs = {}
    for run_dtype in (REF_DTYPE, dtype):
        eager = _model(cfg, "eager", run_dtype)
        refs[run_dtype] = _eager_rows(eager, seq[:, :-1], mask, positions)[:, -2:]
    check_close("compiled decode steps", scores, refs[REF_DTYPE], refs[dtype])


def test_generate_compiles_its_static_cache_decode_step_once():
    """transformers' generate with a static cache compiles the model's forward (here on CPU, with the
    eager backend and fullgraph=True): the masks it builds ahead of each step pass into the compiled
    forward, one graph serves every step, and the tokens are those of the uncompiled generate."""
    import torch._dynamo
    from transformers import CompileConfig

    cfg = _decoder_configs()["llama-gqa"]
    model = _model(cfg, "tileattn", torch.float32)
    ids = torch.randint(3, 97, (2, 7), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    compile_config = CompileConfig(fullgraph=True, backend="eager", dynamic=False)
    compile_config._compile_all_devices = True  # (transformers compiles on accelerators only otherwise)
    options = dict(attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False, pad_token_id=0)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = model.generate(ids, cache_implementation="static", compile_config=compile_config, **options)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    eager = model.generate(ids, cache_implementation="static", disable_compile=True, **options)
    assert torch.equal(compiled, eager)


# --------------------------------------------------------------------------------------------------
# How transformers finds flash_attn through the shim
# --------------------------------------------------------------------------------------------------


def test_transformers_finds_flash_attn_2_through_the_shim():
    """transformers' checks (find_spec, packages_distributions, the version) see FlashAttention 2, not 3
    or 4, and its lazy import hands out tileattn's functions and bert_padding."""
    import transformers.modeling_flash_attention_utils as mfu
    from transformers.utils import import_utils as iu

    real_flash_attn = importlib.util.find_spec("flash_attn") is not None
    with flash_attention_2_via_shim():
        assert "flash-attn" in [p.replace("_", "-") for p in _flash_attn_distributions(iu)]
        assert iu._is_package_available("flash_attn", return_version=True) == (True, "2.8.3")
        assert iu.is_flash_attn_2_available() and iu.is_flash_attn_greater_or_equal("2.8.3")
        assert not iu.is_flash_attn_4_available()
        assert mfu.FLASH_ATTENTION_COMPATIBILITY_MATRIX[2]["pkg_availability_check"]()
        (fa, varlen, kvcache, pad, unpad), _ = mfu.lazy_import_flash_attention("flash_attention_2")
        for fn, name in ((fa, "flash_attn_func"), (varlen, "flash_attn_varlen_func")):
            assert fn.__name__ == name and fn.__module__.startswith("tileattn."), fn
        # (behind torch.compiler.disable's wrapper, where the torch release has one)
        assert inspect.unwrap(kvcache).__module__.startswith("tileattn.")
        assert pad is bert_padding.pad_input and unpad is bert_padding.unpad_input
    if not real_flash_attn:
        assert not iu.is_flash_attn_2_available()
        assert not _flash_attn_distributions(iu)


def test_shim_installed_after_import_transformers(tmp_path):
    """The issue's order: transformers imported (and its availability caches filled) first, then the shim,
    then a model with attn_implementation="flash_attention_2" (flash_attn.__spec__ was None before)."""
    script = tmp_path / "late_shim.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            from transformers import AutoModelForCausalLM, LlamaConfig
            from transformers.utils import import_utils
            mapping = getattr(import_utils, "PACKAGE_DISTRIBUTION_MAPPING", None)
            if mapping is None:
                mapping = import_utils._package_distribution_mapping()
            assert "flash_attn" not in mapping
            import tileattn.shim
            tileattn.shim.install()
            if not torch.cuda.is_available():
                torch.cuda.is_available = lambda: True  # the tensors stay on the CPU
                import_utils.is_torch_cuda_available.cache_clear()
            device = "cuda" if torch.cuda.device_count() else "cpu"
            cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                              num_attention_heads=4, num_key_value_heads=2)
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation="flash_attention_2")
            model = model.to(device, torch.bfloat16)
            mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]], device=device)
            logits = model(torch.tensor([[0, 5, 6, 7], [1, 2, 3, 4]], device=device), attention_mask=mask).logits
            print(model.config._attn_implementation, tuple(logits.shape), bool(logits.isfinite().all()))
            """
        )
    )
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("a real flash_attn is installed: the first assertion of the script does not hold")
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "flash_attention_2 (2, 4, 97) True" in res.stdout, res.stdout + res.stderr


def test_mask_functions_recognised_in_both_packed_forms():
    """The packed-sequence mask is recognised as its base mask plus the sequence ids in both forms
    transformers builds: ``and_masks(remap_positions(base, position_ids), same_sequence(ids))`` (newer) and
    ``and_masks(base, same_sequence(ids))`` (older, before remap_positions_for_packed_sequence); anything
    else is not (and is evaluated into a FlashMask)."""
    from transformers import masking_utils as mu

    from tileattn.integrations import hf_mask

    ids = torch.tensor([[0, 0, 1, 1, 1]])
    window = mu.and_masks(mu.sliding_window_overlay(3), mu.causal_mask_function)
    for base, want in [(mu.causal_mask_function, (True, None)), (window, (True, 3))]:
        assert hf_mask._plain(base) == want
        older = mu.and_masks(base, mu.packed_sequence_mask_function(ids))
        found = hf_mask._packed(older)
        assert found is not None and found[0] == want and found[1] is ids
        if hasattr(mu, "remap_positions_for_packed_sequence"):
            newer = mu.and_masks(
                mu.remap_positions_for_packed_sequence(base, torch.arange(5)[None]),
                mu.packed_sequence_mask_function(ids),
            )
            found = hf_mask._packed(newer)
            assert found is not None and found[0] == want and found[1] is ids
    chunked = mu.and_masks(mu.chunked_overlay(2, torch.zeros(1, dtype=torch.long)), mu.causal_mask_function)
    assert hf_mask._plain(chunked) is None
    assert hf_mask._packed(mu.and_masks(chunked, mu.packed_sequence_mask_function(ids))) is None
    assert hf_mask._packed(mu.and_masks(mu.causal_mask_function, mu.causal_mask_function)) is None
