"""Hugging Face transformers with attn_implementation="tileattn": logits and gradients of small, randomly
initialised models match the "eager" implementation within the tolerance rule, for padded batches
(run as varlen), packed sequences (position_ids restarting at 0) and cached generation."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
import tileattn.integrations.transformers  # noqa: E402,F401  (registers "tileattn")
from tileattn.testing import check_close  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


def _decoder_configs():
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    small = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    return {
        "llama-gqa": LlamaConfig(num_key_value_heads=2, **small),
        "qwen2-gqa": Qwen2Config(num_key_value_heads=2, **small),
        "gpt2": GPT2Config(vocab_size=97, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0),
    }


def _model(cfg, impl, dtype, auto=None):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cls = auto or AutoModelForCausalLM
    return cls.from_config(cfg, attn_implementation=impl).to(DEVICE, dtype).eval()


def _loss(logits, mask):
    return (logits.float().square() * mask[..., None]).mean()


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-gqa", "gpt2"])
def test_decoder_padded_batch_matches_eager(name):
    cfg = _decoder_configs()[name]
    ids = torch.randint(0, 97, (3, 13), device=DEVICE)
    mask = torch.ones(3, 13, dtype=torch.long, device=DEVICE)
    mask[1, :4] = 0  # left padding
    mask[2, 9:] = 0  # right padding
    results = {}
    for impl, dtype in (("tileattn", DTYPE), ("eager", DTYPE), ("eager", torch.float64)):
        model = _model(cfg, impl, dtype)
        logits = model(ids, attention_mask=mask).logits
        grads = torch.autograd.grad(_loss(logits, mask), [p for p in model.parameters() if p.requires_grad])
        results[(impl, dtype)] = (logits, grads)
    real = mask.bool()
    out, grads = results[("tileattn", DTYPE)]
    lowp, lowp_grads = results[("eager", DTYPE)]
    ref, ref_grads = results[("eager", torch.float64)]
    check_close(f"{name} logits", out[real], ref[real], lowp[real])
    scale = torch.stack([g.abs().max() for g in ref_grads])
    for i, (g, r, lg) in enumerate(zip(grads, ref_grads, lowp_grads)):
        check_close(f"{name} grad {i}", g, r, lg, factor=4.0, floor_scale=scale)


def test_packed_sequences_match_separate_runs():
    """One row holding three sequences (position_ids restart at 0) equals the three run alone."""
    cfg = _decoder_configs()["llama-gqa"]
    lengths = [5, 9, 4]
    ids = torch.randint(0, 97, (1, sum(lengths)), device=DEVICE)
    position_ids = torch.cat([torch.arange(n, device=DEVICE) for n in lengths]).unsqueeze(0)
    packed = _model(cfg, "tileattn", DTYPE)(ids, position_ids=position_ids).logits[0]
    eager = _model(cfg, "eager", torch.float64)
    eager_lowp = _model(cfg, "eager", DTYPE)
    start = 0
    for n in lengths:
        piece = ids[:, start : start + n]
        ref = eager(piece).logits[0]
        lowp = eager_lowp(piece).logits[0]
        check_close(f"packed [{start}:{start + n}]", packed[start : start + n], ref, lowp)
        start += n


def test_cached_generation_matches_eager():
    """Greedy generation with a KV cache (one query against the cache per step, left-padded prompt):
    the scores of every step equal an uncached eager forward over the generated sequence."""
    cfg = _decoder_configs()["llama-gqa"]
    ids = torch.randint(3, 97, (2, 7), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    gen = _model(cfg, "tileattn", DTYPE).generate(
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
    ref = _model(cfg, "eager", torch.float64)(seq, attention_mask=full_mask, position_ids=position_ids).logits
    lowp = _model(cfg, "eager", DTYPE)(seq, attention_mask=full_mask, position_ids=position_ids).logits
    steps = slice(6, seq.shape[1] - 1)
    check_close("cached generation scores", scores, ref[:, steps], lowp[:, steps])


def test_bert_encoder_padded_batch_matches_eager():
    from transformers import AutoModel, BertConfig

    cfg = BertConfig(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    ids = torch.randint(0, 97, (3, 11), device=DEVICE)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    mask[2, 2:] = 0
    out = _model(cfg, "tileattn", DTYPE, AutoModel)(ids, attention_mask=mask).last_hidden_state
    ref = _model(cfg, "eager", torch.float64, AutoModel)(ids, attention_mask=mask).last_hidden_state
    lowp = _model(cfg, "eager", DTYPE, AutoModel)(ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    check_close("bert hidden states", out[real], ref[real], lowp[real])


def test_custom_4d_mask_is_refused():
    from tileattn.integrations.transformers import tileattn_attention_forward

    module = torch.nn.Linear(1, 1)
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(NotImplementedError, match="2-D padding mask"):
        tileattn_attention_forward(module, q, q, q, torch.zeros(1, 1, 3, 3))
