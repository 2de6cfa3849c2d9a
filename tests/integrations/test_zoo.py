"""The model zoo (zoo.py): every family with ``attn_implementation="tileattn"`` either matches
``attn_implementation="eager"`` with the same weights or is refused with ``Unsupported`` when the model
is created or first called.

The tolerance rule on the CPU path (fp32): the reference is the family run eager in float64 (its masks
hiding keys with float32's lowest value: ``zoo.finite_eager_masks``), the "plain PyTorch" baseline the
same model run in float32 with eager attention and with SDPA (where the family has it and SDPA's error
is within 4 times eager's: beyond, SDPA computes something else), the worse of the two, and
tileattn's float32 result must be within twice the baseline's error of the reference plus two float32
ulps at the reference's largest magnitude (``tileattn.testing.check_close``). The parameter gradients
are checked as one tensor. (In float32 a whole model's rounding errors are of the same order in every
implementation, and one implementation's error against the reference varies from run to run with the
CPU's summation order: against eager's alone and per gradient tensor, tileattn's error exceeded twice
it now and then, by chance. A wrong mask or a dropped keyword gives errors near 1e-1, a million times
the bound.) Only what the model's output defines is compared: real tokens of padded rows (a padded
query's output is arbitrary), every decoder position of an encoder-decoder.

Scenarios: ``padded`` (three rows: whole, left-padded, right-padded; for encoder-decoders the encoder is
padded and the decoder not, so cross-attention meets a padded encoder; PaliGemma: a bidirectional
prefix, then causal) forward and one backward, on every family. ``unpadded`` (forward and backward),
``packed`` (documents packed in rows, ``position_ids`` restarting, batch 1 and 2, against eager with the
same ``position_ids``, which keeps the documents apart), and greedy ``generate`` with the dynamic and
the static cache (each step's logits against an eager forward over the generated tokens) run on every
family too (``test_scenario``). Families or scenarios that the installed transformers lacks or runs
without the attention interface are skipped, once tileattn's refusal of the latter is checked.
"""

from __future__ import annotations

import inspect
import pathlib
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import zoo  # noqa: E402

from tileattn.integrations.transformers import Unsupported  # noqa: E402
from tileattn.testing import check_close  # noqa: E402

REF, LOWP = torch.float64, torch.float32
IMPL = "tileattn"


@pytest.fixture(autouse=True)
def _finite_eager_masks():
    with zoo.finite_eager_masks():
        yield


def _ids(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, zoo.VOCAB, shape, generator=g)


def padded_inputs(family: zoo.Family):
    """The padded batch and the mask of the outputs it defines."""
    if family.kind == "vision":
        cfg = zoo.tiny_config(family)
        channels = getattr(cfg, "num_channels", 3)
        g = torch.Generator().manual_seed(1)
        size = getattr(cfg, "image_size", 32)
        pixels = torch.randn(2, channels, size, size, generator=g)
        return {"pixel_values": pixels}, None
    if family.kind == "vlm":  # a prefix (4 image tokens and a prompt) seen both ways, then causal
        cfg = zoo.tiny_config(family)
        size = cfg.vision_config.image_size
        pixels = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))
        ids = _ids((2, 12), 1).clamp(max=zoo.VOCAB - 2)
        ids[:, :4] = cfg.image_token_id
        token_type_ids = torch.ones_like(ids)
        token_type_ids[0, :7] = 0
        token_type_ids[1, :9] = 0
        return {"input_ids": ids, "pixel_values": pixels, "token_type_ids": token_type_ids}, None
    ids = _ids((3, 12), 1)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    mask[2, 9:] = 0  # right padding
    if family.kind == "encdec":
        decoder = torch.cat([torch.full((3, 1), zoo.BOS), _ids((3, 6), 2)], 1)
        if family.name == "whisper":
            features = torch.randn(3, 8, 32, generator=torch.Generator().manual_seed(3))
            return {"input_features": features, "decoder_input_ids": decoder}, None
        return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": decoder}, None
    return {"input_ids": ids, "attention_mask": mask}, mask.bool()


def _output(out):
    logits = getattr(out, "logits", None)
    return logits if logits is not None else out.last_hidden_state


def _grads(model, output, where):
    weight = torch.ones(output.shape[:-1]) if where is None else where.to(output.dtype)
    loss = (output.square() * weight[..., None]).mean()
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]


SDPA_AGREES = 4.0  # SDPA's error counts only within this factor of eager's: beyond, it computes something else


def _worse(ref, eager, sdpa):
    """PyTorch's result in fp32 that is farther from ``ref``: eager attention's, or SDPA's where SDPA
    computes the same function (its error within ``SDPA_AGREES`` times eager's, as rounding varies; a
    family whose SDPA path drops what eager applies must not widen the bound)."""

    def error(t):
        return (t.double() - ref.double()).abs().max().item() if t.numel() else 0.0

    # (SDPA's NaN in a row that sees no key reaches real tokens as eager attention's does in float64)
    if sdpa is None or not bool(sdpa.isfinite().all()) or error(sdpa) > SDPA_AGREES * error(eager) + 1e-30:
        return eager
    return max(eager, sdpa, key=error)


def _baseline_runs(family, run):
    """``run(impl, dtype)`` for eager and, where the family has it, SDPA in fp32 (None where it has not:
    its model refuses "sdpa", or its attention arguments, e.g. a softcap)."""
    lowp = run("eager", LOWP)
    try:
        sdpa = run("sdpa", LOWP)
    except (ValueError, NotImplementedError, RuntimeError):  # (SDPA refuses the family or its arguments)
        sdpa = None
    return lowp, sdpa


def check_against_eager(family, inputs, where, backward=True, label="padded"):
    """Runs ``inputs`` through the family on tileattn (fp32) and in plain PyTorch (eager fp64, the
    reference; eager and SDPA fp32, the baselines) and checks the outputs and the parameter gradients by
    the tolerance rule."""

    def run(impl, dtype):
        model = zoo.build(family, impl, dtype)
        cast = {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}
        output = _output(model(**cast))
        pick = output if where is None else output[where]
        grads = _grads(model, output, where) if backward else []
        return pick, torch.cat([g.reshape(-1) for g in grads]) if grads else None

    (out, grads), (ref, ref_grads) = run(IMPL, LOWP), run("eager", REF)
    eager, sdpa = _baseline_runs(family, run)
    check_close(f"{family.name} {label} output", out, ref, _worse(ref, eager[0], sdpa and sdpa[0]))
    if backward:
        lowp_grads = _worse(ref_grads, eager[1], sdpa and sdpa[1])
        check_close(f"{family.name} {label} parameter gradients", grads, ref_grads, lowp_grads)


def check_refused(family, inputs):
    pattern = family.refused
    with pytest.raises(Unsupported, match=pattern):
        model = zoo.build(family, IMPL)
        model(**inputs)


def unpadded_inputs(family: zoo.Family):
    inputs, _ = padded_inputs(family)
    inputs.pop("attention_mask", None)
    return inputs, None


def packed_inputs(rows: list[list[int]]):
    """Documents of ``rows`` lengths packed in rows (equal totals), ``position_ids`` restarting at each
    document; no cache, so that transformers' masks keep the documents apart."""
    ids = _ids((len(rows), sum(rows[0])), 4)
    position_ids = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in rows])
    return {"input_ids": ids, "position_ids": position_ids, "use_cache": False}, None


def _steps_against_eager(family, gen, prompt_len, inputs, label):
    """Each generated step's logits against eager forwards (fp64, fp32) over the generated tokens."""
    seq = gen.sequences
    scores = torch.stack(gen.logits, 1)  # (batch, steps, vocab), the raw logits of each step

    def run(impl, dtype):
        model = zoo.build(family, impl, dtype)
        cast = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
        if family.kind == "encdec":
            return model(**cast, decoder_input_ids=seq[:, :-1]).logits
        if family.kind == "vlm":  # (the generated tokens are suffix: token type 1)
            new = torch.ones_like(seq[:, prompt_len:-1])
            token_type_ids = torch.cat([inputs["token_type_ids"], new], 1)
            out = model(seq[:, :-1], pixel_values=cast["pixel_values"], token_type_ids=token_type_ids).logits
            return out[:, prompt_len - 1 :]
        mask = torch.cat([inputs["attention_mask"], torch.ones_like(seq[:, prompt_len:])], 1)
        extra = {}
        if "position_ids" in inspect.signature(model.forward).parameters:
            extra["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
        return model(seq, attention_mask=mask, use_cache=False, **extra).logits[:, prompt_len - 1 : -1]

    ref = run("eager", REF)
    eager, sdpa = _baseline_runs(family, run)
    check_close(f"{family.name} {label} step logits", scores, ref, _worse(ref, eager, sdpa))


def check_generate(family, cache: str, inputs=None):
    """Greedy generation (left-padded prompts; the encoder's rows padded for encoder-decoders) with the
    dynamic or the static cache."""
    steps = 5
    if family.kind == "encdec":
        inputs, _ = padded_inputs(family)
        inputs.pop("decoder_input_ids")
        prompt_len = None
    elif family.kind == "vlm":
        inputs, _ = padded_inputs(family)
        prompt_len = inputs["input_ids"].shape[1]
    elif inputs is not None:
        prompt_len = inputs["input_ids"].shape[1]
    else:
        ids = _ids((2, 7), 5)
        mask = torch.ones_like(ids)
        mask[0, :2] = 0
        inputs, prompt_len = {"input_ids": ids, "attention_mask": mask}, 7
    options = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=zoo.PAD)
    options.update(output_logits=True, return_dict_in_generate=True)
    if cache == "static":
        options["cache_implementation"] = "static"
    model = zoo.build(family, IMPL, LOWP)
    try:
        gen = model.generate(**inputs, **options)
    except Unsupported:
        raise
    except Exception as error:
        try:  # (a failure of transformers' own generate, e.g. 5.17's chunked masks with a static cache)
            zoo.build(family, "sdpa", LOWP).generate(**inputs, **options)
        except type(error) as same:
            if str(same) == str(error):
                pytest.skip(f"transformers {transformers.__version__}'s generate fails with sdpa too: {error}")
        raise
    _steps_against_eager(family, gen, prompt_len, inputs, f"generate ({cache} cache)")


_OWN_CODE: dict[str, bool] = {}  # family id -> _own_attention_code (one eager build per family)


def _own_attention_code(family) -> bool:
    """Whether none of the installed transformers' modeling files that the family's model is built from
    goes through the attention interface (older releases of some families, e.g. Falcon and GPT-J in 5.17)."""
    if family.id not in _OWN_CODE:
        files = {type(m).__module__ for m in zoo.build(family, "eager").modules()}
        files = {f for f in files if f.startswith("transformers.models.")}
        _OWN_CODE[family.id] = not any("ALL_ATTENTION_FUNCTIONS" in inspect.getsource(sys.modules[f]) for f in files)
    return _OWN_CODE[family.id]


def _run(family, scenario: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = family.model_type or family.name
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type!r}")
    if family.refused != zoo.OWN_CODE and _own_attention_code(family):
        # (then tileattn must refuse it, as it does the families the table refuses for that reason)
        with pytest.raises(Unsupported, match=zoo.OWN_CODE):
            zoo.build(family, IMPL)
        pytest.skip(f"transformers {transformers.__version__}'s {family.name} runs its own attention code: refused")
    if scenario == "padded":
        inputs, where = padded_inputs(family)
    elif scenario == "unpadded":
        inputs, where = unpadded_inputs(family)
    elif scenario == "packed":
        inputs, where = packed_inputs([[5, 4, 3]])
    elif scenario == "packed2":
        inputs, where = packed_inputs([[5, 7], [3, 4, 5]])
    else:
        inputs, where = padded_inputs(family)
    if family.refused:
        return check_refused(family, inputs)
    if scenario.startswith("generate"):
        return check_generate(family, scenario.split("-")[1])
    check_against_eager(family, inputs, where, label=scenario)


SCENARIOS = {
    "decoder": ["unpadded", "packed", "packed2", "generate-dynamic", "generate-static"],
    "encoder": ["unpadded"],
    "encdec": ["unpadded", "generate-dynamic", "generate-static"],
    "vision": [],
    "vlm": ["generate-dynamic", "generate-static"],
}


@pytest.mark.parametrize("family", zoo.FAMILIES, ids=lambda f: f.id)
def test_padded(family):
    """The main scenario, on every family."""
    _run(family, "padded")


@pytest.mark.parametrize(
    "family, scenario",
    [pytest.param(f, s, id=f"{f.id}-{s}") for f in zoo.FAMILIES for s in SCENARIOS[f.kind]],
)
def test_scenario(family, scenario):
    """Every other scenario of every family."""
    _run(family, scenario)


@pytest.mark.parametrize("name", ["mistral", "modernbert", "gemma2"])
def test_padding_between_tokens_with_a_sliding_window(name):
    """Padding between a row's tokens under a sliding window (causal: Mistral; bidirectional: ModernBERT's
    local layers): varlen would close the hole and move keys into the window, so the mask runs as a
    FlashMask and matches eager; with a softcap (Gemma 2), which a FlashMask does not take, it is refused."""
    family = next(f for f in zoo.FAMILIES if f.name == name)
    inputs, _ = padded_inputs(family)
    inputs["attention_mask"][0, 5:7] = 0
    if name == "gemma2":
        with pytest.raises(Unsupported, match="softcap"):
            zoo.build(family, IMPL)(**inputs)
        return
    check_against_eager(family, inputs, inputs["attention_mask"].bool(), label="hole")


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_with_padding_between_tokens(cache):
    """A prompt with padding between its tokens: with a static cache (whose fast path needs each row's
    keys in one run) it runs as a FlashMask, and both caches match eager."""
    family = next(f for f in zoo.FAMILIES if f.name == "llama")
    ids = _ids((2, 7), 5)
    mask = torch.ones_like(ids)
    mask[0, 3:5] = 0
    check_generate(family, cache, {"input_ids": ids, "attention_mask": mask})


def test_docs_table_is_the_zoo():
    """docs/huggingface.md's table of families is zoo.py's, status and reasons included."""
    docs = (pathlib.Path(__file__).parents[2] / "docs" / "huggingface.md").read_text()
    assert zoo.table() in docs, "docs/huggingface.md: paste the output of python tests/integrations/zoo.py"
