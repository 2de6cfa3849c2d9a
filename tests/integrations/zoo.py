"""The model zoo: transformers' model families as tiny random models, for test_zoo.py and the table of
docs/huggingface.md (``python tests/integrations/zoo.py`` prints it).

Each ``Family`` names a transformers model type, the kind of model it is (decoder, encoder,
encoder-decoder, vision), what its tiny configuration changes, and either None (it matches eager
attention) or how tileattn refuses it (``refused``: a pattern of the error; ``reason``: why, for the
docs). Weights are drawn at unit scale (every matrix N(0, 1/fan_in)), so that attention is far from
uniform and a wrong mask shows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch

VOCAB = 128
PAD, BOS, EOS = 0, 1, 2

# Sizes set in every configuration that has the attribute (most families name a subset of them).
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    d_model=64,
    n_embd=64,
    embed_dim=64,
    max_position_embeddings=128,
    n_positions=128,
    num_hidden_layers=2,
    n_layer=2,
    num_layers=2,
    encoder_layers=2,
    decoder_layers=2,
    num_attention_heads=4,
    n_head=4,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    ffn_dim=96,
    encoder_ffn_dim=96,
    decoder_ffn_dim=96,
    d_ff=96,
    n_inner=96,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    # every token to every expert: top-k routing is discontinuous, and a near-tie that rounding breaks
    # differently changes a token's experts (an error of order 1 in any implementation)
    num_experts=2,
    num_local_experts=2,
    n_routed_experts=2,
    num_experts_per_tok=2,
    moe_topk=2,
    top_k=2,
    moe_num_experts=2,
    moe_k=2,
    head_dim=16,
    d_kv=16,
    pad_token_id=PAD,
    bos_token_id=BOS,
    eos_token_id=EOS,
    decoder_start_token_id=BOS,
    sliding_window=6,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    image_size=32,
    patch_size=8,
)
MLA = dict(
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=12,
    head_dim=8,
    num_key_value_heads=4,
)


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # transformers model type
    kind: str  # "decoder", "encoder", "encdec", "vision"
    config: dict = dataclasses.field(default_factory=dict)
    refused: str | None = None  # a pattern of the refusal's message; None: matches eager
    reason: str = ""  # why it is refused (docs/huggingface.md)
    model_type: str | None = None  # the config's model type, when it differs from the name
    auto: str | None = None  # the transformers Auto class, when not the kind's
    sinks: bool = False  # attention sinks (s_aux): needs tileattn's learnable_sink
    scale: float = 1.0  # of the weights (a model that fp32 cannot compute at unit scale gets less)

    @property
    def id(self) -> str:
        return self.name


def D(name, **config):
    return Family(name, "decoder", config)


OWN_CODE = "computes attention with its own code"
OWN_CODE_REASON = "computes attention with its own code, not through transformers' attention interface"
OUTSIDE = "used outside tileattn's attention function"
BIAS = "position_bias"
BIAS_REASON = "adds a learned relative-position bias (position_bias) to the scores"


FAMILIES = [
    # ---- decoders
    D("afmoe"),
    D("apertus"),
    D("arcee"),
    D("bitnet"),
    D("cohere"),
    D("cohere2"),
    D("cohere2_moe"),
    D("cwm"),
    D("deepseek_v2", **MLA),
    D("deepseek_v3", **MLA),
    D("diffllama"),
    D("ernie4_5"),
    D("ernie4_5_moe"),
    D("exaone4"),
    D("exaone_moe"),
    D("falcon", num_kv_heads=2, new_decoder_architecture=True, ffn_hidden_size=96),
    D("flex_olmo"),
    D("gemma"),
    D("gemma2"),
    D("gemma3_text"),
    D("glm"),
    D("glm4"),
    D("glm4_moe"),
    D("gpt2"),
    D("gpt_bigcode"),
    D("gpt_neox"),
    D("gptj", rotary_dim=8),
    D("codegen", rotary_dim=8),
    Family("gpt_oss", "decoder", sinks=True),
    D("granite"),
    D("granitemoe"),
    D("granitemoeshared"),
    Family("granite_swa", "decoder", sinks=True),
    Family("granitemoe_swa", "decoder", sinks=True),
    D("helium"),
    D("hunyuan_v1_dense"),
    D("hunyuan_v1_moe"),
    D("jetmoe"),
    D("llama"),
    D("llama4_text", attention_chunk_size=4, intermediate_size_mlp=96, no_rope_layer_interval=2),
    Family("mimo_v2_flash", "decoder", {"v_head_dim": 12}, sinks=True),
    D("minimax"),
    D("ministral"),
    D("mistral"),
    D("mixtral"),
    D("modernbert-decoder"),
    D("nemotron"),
    D("olmo"),
    D("olmo2"),
    D("olmo3"),
    D("olmoe"),
    D("opt", word_embed_proj_dim=64),
    D("persimmon"),
    D("phi"),
    D("phi3"),
    D("phimoe"),
    D("qwen2"),
    D("qwen2_moe"),
    D("qwen3"),
    D("qwen3_moe"),
    D("seed_oss"),
    D("smollm3"),
    D("stablelm"),
    D("starcoder2"),
    D("vaultgemma"),
    D("biogpt"),
    Family("flint", "decoder", sinks=True),
    D("nanochat"),
    D("lfm2"),
    D("hy_v3"),
    D("laguna"),
    D("minimax_m2"),
    D("jais2"),
    D("hyperclovax"),
    D("solar_open"),
    D("minicpm5_moe"),
    D("falcon_h1", mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8, mamba_d_state=16, mamba_chunk_size=16),
    Family(
        "doge",
        "decoder",
        refused=OUTSIDE,
        reason="adds a learned dynamic mask (a bias computed from the values) to the attention mask",
    ),
    Family(
        "deepseek_v32",
        "decoder",
        {**MLA, "index_n_heads": 2, "index_head_dim": 16, "index_topk": 4},
        refused=OUTSIDE,
        reason="sparse attention: the indexer reads the mask, and the attention takes top-k key indices",
    ),
    Family(
        "falcon-alibi",
        "decoder",
        {"alibi": True, "num_kv_heads": 2, "new_decoder_architecture": True, "ffn_hidden_size": 96},
        model_type="falcon",
        refused=OUTSIDE,
        reason="with ALiBi, Falcon computes attention with its own code (without ALiBi it matches)",
    ),
    Family("bloom", "decoder", refused=OWN_CODE, reason=OWN_CODE_REASON),
    Family(
        "gpt_neo",
        "decoder",
        {"num_heads": 4, "attention_types": [[["global", "local"], 1]]},
        refused=OWN_CODE,
        reason=OWN_CODE_REASON,
    ),
    Family("gpt_neox_japanese", "decoder", refused=OWN_CODE, reason=OWN_CODE_REASON),
    Family("mpt", "decoder", {"n_heads": 4, "n_layers": 2}, refused=OWN_CODE, reason=OWN_CODE_REASON),
    Family("xglm", "decoder", {"attention_heads": 4}, refused=OWN_CODE, reason=OWN_CODE_REASON),
    D("ctrl", dff=96),
    # ---- vision-language
    Family(
        "paligemma",
        "vlm",
        {
            "vision_config": dict(
                model_type="siglip_vision_model",
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=16,
                patch_size=8,
            ),
            "text_config": dict(
                model_type="gemma",
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                vocab_size=VOCAB,
                intermediate_size=96,
            ),
            "image_token_id": VOCAB - 1,
            "projection_dim": 64,
            "vocab_size": VOCAB,
        },
    ),
    # ---- encoders
    Family("bert", "encoder"),
    Family("roberta", "encoder"),
    Family("xlm-roberta", "encoder"),
    Family("camembert", "encoder"),
    Family("electra", "encoder", {"embedding_size": 64}),
    Family("ernie", "encoder"),
    Family("albert", "encoder", {"embedding_size": 64}),
    Family("distilbert", "encoder", {"dim": 64, "n_layers": 2, "n_heads": 4, "hidden_dim": 96}),
    Family("esm", "encoder"),
    Family("modernbert", "encoder", {"local_attention": 4, "global_attn_every_n_layers": 2}),
    Family("eurobert", "encoder"),
    Family("nomic_bert", "encoder"),
    Family("mobilebert", "encoder", {"embedding_size": 32, "intra_bottleneck_size": 32, "num_feedforward_networks": 1}),
    Family("roberta-prelayernorm", "encoder"),
    Family("xlm-roberta-xl", "encoder"),
    Family("clip_text_model", "encoder"),
    # ---- encoder-decoders
    Family("bart", "encdec"),
    Family("mbart", "encdec"),
    Family("marian", "encdec"),
    Family("pegasus", "encdec"),
    Family("blenderbot", "encdec"),
    Family("blenderbot-small", "encdec"),
    Family("plbart", "encdec"),
    Family("m2m_100", "encdec"),
    Family("nllb-moe", "encdec"),
    Family("pegasus_x", "encdec"),
    Family("t5", "encdec", refused=BIAS, reason=BIAS_REASON),
    Family("mt5", "encdec", refused=BIAS, reason=BIAS_REASON),
    Family("umt5", "encdec", refused=BIAS, reason=BIAS_REASON),
    Family("longt5", "encdec", refused=BIAS, reason=BIAS_REASON),
    Family("switch_transformers", "encdec", {"num_experts": 4, "expert_capacity": 8}, refused=BIAS, reason=BIAS_REASON),
    Family("mvp", "encdec", refused=OWN_CODE, reason=OWN_CODE_REASON),
    Family(
        "whisper",
        "encdec",
        auto="AutoModelForSpeechSeq2Seq",
        config={"num_mel_bins": 8, "max_source_positions": 16, "max_target_positions": 64},
    ),
    # ---- vision
    Family("vit", "vision"),
    Family("deit", "vision"),
    Family("dinov2", "vision"),
    Family("dinov2_with_registers", "vision"),
    Family("vit_msn", "vision"),
    Family("ijepa", "vision"),
    Family("siglip_vision_model", "vision"),
    Family("clip_vision_model", "vision"),
    Family("pixtral", "vision"),
    Family("dinov3_vit", "vision"),
]


def tiny_config(family: Family):
    """The family's configuration: its defaults, COMMON's sizes where it has them, then its own (a
    vision-language model's only its own)."""
    from transformers import AutoConfig

    model_type = family.model_type or family.name
    if family.kind == "vlm":
        return AutoConfig.for_model(model_type, **family.config)
    defaults = AutoConfig.for_model(model_type).to_dict()
    sizes = {key: value for key, value in COMMON.items() if key in defaults}
    return AutoConfig.for_model(model_type, **{**sizes, **family.config})


@contextlib.contextmanager
def finite_eager_masks():
    """Eager attention's masks hide keys with float32's lowest value in float64 models too. transformers
    fills a mask with its dtype's lowest value, which eager attention's float32 softmax turns into -inf in
    a float64 model: a row that sees no key (a left-padded query) becomes NaN, and the next layer's zero
    weights spread it to the real tokens (0 · NaN). With float32's lowest, hidden keys still weigh exactly
    0 (its exponential underflows in float64 too) and such a row is what it is in float32, a mean that
    no real token sees."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    def finite(*args, dtype=torch.float32, **kwargs):
        return eager_mask(*args, dtype=torch.float32 if dtype == torch.float64 else dtype, **kwargs)

    ALL_MASK_ATTENTION_FUNCTIONS.register("eager", finite)
    try:
        yield
    finally:
        ALL_MASK_ATTENTION_FUNCTIONS.register("eager", eager_mask)


def init_unit_scale(model: torch.nn.Module, scale: float = 1.0, seed: int = 0) -> None:
    """Every matrix N(0, scale² / fan_in) and attention sinks N(0, 1), the same for every attention
    implementation (drawn from one generator in parameter order)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and p.numel():
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * (scale / math.sqrt(fan_in)))
            elif "sink" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))


def auto_class(family: Family):
    import transformers

    if family.auto:
        return getattr(transformers, family.auto)
    return {
        "decoder": transformers.AutoModelForCausalLM,
        "encoder": transformers.AutoModel,
        "encdec": transformers.AutoModelForSeq2SeqLM,
        "vision": transformers.AutoModel,
        "vlm": transformers.AutoModelForImageTextToText,
    }[family.kind]


def build(family: Family, impl: str, dtype: torch.dtype = torch.float32):
    """The family's tiny model with ``attn_implementation=impl``, in ``dtype``, eval mode (no dropout)."""
    cfg = tiny_config(family)
    torch.manual_seed(0)  # (what init_unit_scale leaves, e.g. biases, transformers draws: the same for every build)
    # (the experts' eager loop: grouped_mm has no float64)
    model = auto_class(family).from_config(cfg, attn_implementation=impl, experts_implementation="eager")
    init_unit_scale(model, family.scale)
    return model.to(dtype).eval()


KINDS = {
    "decoder": "decoder",
    "vlm": "vision-language",
    "encoder": "encoder",
    "encdec": "encoder-decoder",
    "vision": "vision",
}


def status(family: Family) -> str:
    if family.refused:
        return f"refused: {family.reason}"
    return "matches eager (attention sinks)" if family.sinks else "matches eager"


def table() -> str:
    """The zoo as docs/huggingface.md shows it (a test keeps the two the same)."""
    rows = ["| family (model type) | kind | with tileattn |", "|---|---|---|"]
    rows += [f"| {f.name} | {KINDS[f.kind]} | {status(f)} |" for f in FAMILIES]
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
