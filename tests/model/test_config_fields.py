"""Every field of every served family's transformers config class (and the fields its checkpoints write in
transformers 4's style), sorted by what pdserve does with it:

- Used: pdserve's ModelConfig follows it (a changed value changes the ModelConfig);
- Refused: a value pdserve does not compute is refused at load, in an error that names the field;
- Irrelevant: it does not change the logits (the reason says why; transformers' own logits are checked unchanged).

The test fails where transformers grows a field this table does not sort, where pdserve stops following a field
it uses or stops refusing one it cannot compute, and where `config.DEFAULTS` (what an omitted field means)
drifts from transformers' class defaults.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from pdserve.server.model.config import ARCHITECTURES, DEFAULTS, ModelLoadError, parse_config

CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
           "gemma2": "Gemma2Config", "gemma3": "Gemma3TextConfig", "mixtral": "MixtralConfig",
           "qwen3_moe": "Qwen3MoeConfig", "deepseek_v2": "DeepseekV2Config", "deepseek_v3": "DeepseekV3Config"}
ARCH = {family: arch for arch, family in ARCHITECTURES.items()}
SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 96, "max_position_embeddings": 128}
MOE_SHAPE = {"mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
             "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}}
_MLA_SHAPE = {"num_key_value_heads": 4, "head_dim": 8, "kv_lora_rank": 16, "q_lora_rank": 24, "qk_nope_head_dim": 8,
              "qk_rope_head_dim": 8, "v_head_dim": 8, "n_routed_experts": 8, "num_experts_per_tok": 2,
              "moe_intermediate_size": 16, "first_k_dense_replace": 1}
MOE_SHAPE["deepseek_v2"] = _MLA_SHAPE
MOE_SHAPE["deepseek_v3"] = dict(_MLA_SHAPE, n_group=2, topk_group=1)
DROP = object()
"""As a value: the field removed from config.json."""
Probe = Any | Callable[[Any], Any]
"""A value to write, or a function of the value the base config holds."""


@dataclass(frozen=True)
class Used:
    probe: Probe
    context: dict[str, Any] = field(default_factory=dict)
    """Fields set (or DROPped) in both configs compared: where the field takes effect."""


@dataclass(frozen=True)
class Refused:
    probe: Probe
    context: dict[str, Any] = field(default_factory=dict)
    match: str | None = None
    """What the error says (default: the field's name)."""


@dataclass(frozen=True)
class Irrelevant:
    reason: str
    probe: Probe
    context: dict[str, Any] = field(default_factory=dict)
    unchecked: str | None = None
    """Why transformers' logits cannot be compared with the field changed (None: they are)."""


Treatment = Used | Refused | Irrelevant
double = lambda v: 2 * v  # noqa: E731
flip = lambda v: not v  # noqa: E731
_NO_TYPES = {"layer_types": DROP}  # where the layers' kinds follow from other fields (transformers 4's configs)

COMMON: dict[str, tuple[Treatment, ...]] = {
    # PretrainedConfig's own fields
    "architectures": (Refused(["GPTNeoXForCausalLM"], match="architecture"),),
    "model_type": (Irrelevant("architectures picks the model; model_type only transformers' config class", "gpt2"),),
    "transformers_version": (Irrelevant("the writer's version", "0.0.1"),),
    "dtype": (Used("bfloat16"),),
    "output_hidden_states": (Irrelevant("what forward returns besides the logits", True),),
    "output_attentions": (Irrelevant("what forward returns besides the logits", True),),
    "return_dict": (Irrelevant("what forward returns besides the logits", False,
                               unchecked="transformers 5's own forward fails with it false"),),
    "chunk_size_feed_forward": (Irrelevant("read by no served family's modeling code", 4),),
    "is_encoder_decoder": (Irrelevant("read by no served family's forward (every one is decoder-only)", True),),
    "id2label": (Irrelevant("sequence-classification heads only", {0: "a", 1: "b", 2: "c"}),),
    "label2id": (Irrelevant("sequence-classification heads only", {"a": 0, "b": 1, "c": 2}),),
    "problem_type": (Irrelevant("sequence-classification heads only", "regression"),),
    "_name_or_path": (Irrelevant("where transformers loaded it from", "elsewhere"),),
    # every family's
    "vocab_size": (Used(double),),
    "hidden_size": (Used(double),),
    "intermediate_size": (Used(double),),
    "num_hidden_layers": (Used(double, _NO_TYPES),),
    "num_attention_heads": (Used(double),),
    "num_key_value_heads": (Used(lambda v: 4),),
    "head_dim": (Used(double),),
    "max_position_embeddings": (Used(lambda v: 64),),
    "rms_norm_eps": (Used(lambda v: 1e-3),),
    "tie_word_embeddings": (Used(flip),),
    "initializer_range": (Irrelevant("training's initialisation", 0.5),),
    "use_cache": (Irrelevant("whether generate keeps a KV cache: the same logits", False),),
    "attention_dropout": (Irrelevant("dropout is off at inference", 0.5),),
    "pad_token_id": (Irrelevant("the id prompts are padded with: padding is masked, never attended", 5),),
    "bos_token_id": (Used(5),),
    "eos_token_id": (Used(5),),
    "rope_parameters": (Used({"rope_type": "default", "rope_theta": 12345.0}),
                        Refused({"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}, match="rope_type 'yarn'")),
    # what checkpoints write beside the class's fields (transformers 4's names, and the quantizers')
    "torch_dtype": (Used("bfloat16", {"dtype": DROP}),),
    "rope_theta": (Used(12345.0, {"rope_parameters": DROP}),),
    "rope_scaling": (Used({"rope_type": "linear", "factor": 2.0}, {"rope_parameters": DROP}),
                     Refused({"type": "dynamic", "factor": 2.0}, {"rope_parameters": DROP}, match="type 'dynamic'")),
    "partial_rotary_factor": (Refused(0.5),),
    "quantization_config": (Refused({"quant_method": "awq", "bits": 4}),),
    "attn_logit_softcapping": (Refused(50.0),),
    "final_logit_softcapping": (Refused(30.0),),
}
"""Each field's treatment in every family, unless the family's own table says otherwise."""

_DENSE: dict[str, tuple[Treatment, ...]] = {"hidden_act": (Refused("gelu"),)}
_QWEN_WINDOWS: dict[str, tuple[Treatment, ...]] = {
    "use_sliding_window": (Used(True, {"sliding_window": 24, "max_window_layers": 1, **_NO_TYPES}),),
    "sliding_window": (Used(24, {"use_sliding_window": True, "max_window_layers": 1, **_NO_TYPES}),),
    "max_window_layers": (Used(1, {"use_sliding_window": True, "sliding_window": 24, **_NO_TYPES}),),
    "layer_types": (Used(["full_attention", "sliding_attention"], {"use_sliding_window": True, "sliding_window": 24}),
                    Refused(["full_attention", "chunked_attention"], match="layer_types with 'chunked_attention'")),
}
_GEMMA: dict[str, tuple[Treatment, ...]] = {
    "hidden_activation": (Refused("gelu"),),
    "hidden_act": (Irrelevant("transformers' Gemma reads hidden_activation", "silu"),),
    "query_pre_attn_scalar": (Used(64),),
    "sliding_window": (Used(8),),
    "layer_types": (Used(["full_attention", "full_attention"]),),
    "attention_bias": (Refused(True, match="attention_bias true"),),
    "use_bidirectional_attention": (Refused(True, match="use_bidirectional_attention true"),),
    "final_logit_softcapping": (Used(10.0),),
    "cache_implementation": (Irrelevant("the cache class transformers' generate builds", "static"),),
}
_IGNORES_LAYER_TYPES = Irrelevant("the family's transformers model windows every layer by sliding_window alone",
                                  ["sliding_attention", "full_attention"])
_ROUTER_LOSS = Irrelevant("the router's auxiliary loss, in training only", 0.5)
_ROUTER_LOGITS = Irrelevant("whether forward returns the router's logits besides the logits", True)

FAMILY: dict[str, dict[str, tuple[Treatment, ...]]] = {
    "llama": {**_DENSE, "attention_bias": (Refused(True, match="attention_bias true"),),
              "mlp_bias": (Refused(True, match="mlp_bias true"),),
              "pretraining_tp": (Irrelevant("transformers 5's Llama does not read it (4's split the projections' "
                                            "matmuls in slices: the same sums)", 2),),
              "layer_types": (Refused(["sliding_attention", "full_attention"]),)},
    "mistral": {**_DENSE, "sliding_window": (Used(8),),
                "attention_bias": (Irrelevant("transformers' Mistral builds its projections without biases", True),),
                "mlp_bias": (Irrelevant("transformers' Mistral builds its MLP without biases", True),),
                "layer_types": (_IGNORES_LAYER_TYPES,)},
    "qwen2": {**_DENSE, **_QWEN_WINDOWS,
              "attention_bias": (Irrelevant("transformers' Qwen2 always biases q, k and v, never o", False),)},
    "qwen3": {**_DENSE, **_QWEN_WINDOWS, "attention_bias": (Refused(True, match="attention_bias true"),)},
    "gemma2": {**_GEMMA, "attn_logit_softcapping": (Used(10.0),),
               "sliding_window_size": (Irrelevant("early Gemma 2 checkpoints' name; transformers reads sliding_window",
                                                  8),)},
    "gemma3": {**_GEMMA,
               # transformers' Gemma3Attention keeps the field but never passes it to the attention (nor does
               # vLLM's Gemma 3): test_transformers_gemma3_ignores_its_attention_softcap
               "attn_logit_softcapping": (Refused(10.0),),
               "rope_parameters": (
                   Used({"full_attention": {"rope_type": "default", "rope_theta": 12345.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
                   Refused({"full_attention": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}, match="'yarn'")),
               "rope_local_base_freq": (Used(12345.0, {"rope_parameters": DROP}),),
               "sliding_window_pattern": (Used(2, _NO_TYPES),),
               "_sliding_window_pattern": (Irrelevant("transformers 5 writes it beside layer_types; transformers "
                                                      "reads a pattern from sliding_window_pattern only", 2, _NO_TYPES),)},
    "mixtral": {**_DENSE, "sliding_window": (Used(8),), "num_local_experts": (Used(8),),
                "num_experts_per_tok": (Used(1),), "output_router_logits": (_ROUTER_LOGITS,),
                "router_aux_loss_coef": (_ROUTER_LOSS,),
                "router_jitter_noise": (Irrelevant("the router's input noise, in training only", 0.5),),
                "layer_types": (_IGNORES_LAYER_TYPES,)},
    "qwen3_moe": {**_DENSE, "attention_bias": (Refused(True, match="attention_bias true"),),
                  "use_sliding_window": (Used(True, {"sliding_window": 24}),),
                  "sliding_window": (Used(24, {"use_sliding_window": True}),),
                  "num_local_experts": (Used(8, {"num_experts": DROP}),), "num_experts": (Used(8),),
                  "num_experts_per_tok": (Used(1),), "moe_intermediate_size": (Used(double),),
                  "norm_topk_prob": (Used(flip),), "decoder_sparse_step": (Refused(2),),
                  "mlp_only_layers": (Refused([0]),), "output_router_logits": (_ROUTER_LOGITS,),
                  "router_aux_loss_coef": (_ROUTER_LOSS,), "layer_types": (_IGNORES_LAYER_TYPES,),
                  "max_window_layers": (Irrelevant("Qwen3-MoE checkpoints write it; transformers' Qwen3-MoE windows "
                                                   "every layer when use_sliding_window", 1,
                                                   {"use_sliding_window": True, "sliding_window": 24}),)},
}
_MLA: dict[str, tuple[Treatment, ...]] = {
    **_DENSE, "attention_bias": (Refused(True, match="attention_bias true"),),
    "num_key_value_heads": (Refused(2, match="num_key_value_heads 2"),),
    "num_attention_heads": (Used(double, {"num_key_value_heads": None}),),
    "qk_head_dim": (Irrelevant("transformers derives it from qk_nope_head_dim + qk_rope_head_dim", double),),
    "rope_parameters": (Used({"rope_type": "default", "rope_theta": 12345.0}),
                        Used({"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "mscale": 1.0,
                              "mscale_all_dim": 0.7, "original_max_position_embeddings": 32}),
                        Refused({"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}, match="'dynamic'")),
    "kv_lora_rank": (Used(double),), "q_lora_rank": (Used(double), Used(lambda v: None)),
    "qk_nope_head_dim": (Used(double),), "qk_rope_head_dim": (Used(double, {"head_dim": DROP}),
                                                            Refused(lambda v: 7, {"head_dim": DROP})),
    "v_head_dim": (Used(double),), "moe_intermediate_size": (Used(double),), "n_routed_experts": (Used(double),),
    "num_experts_per_tok": (Used(1),), "n_shared_experts": (Used(lambda v: 3),), "first_k_dense_replace": (Used(0),),
    "routed_scaling_factor": (Used(2.0),), "output_router_logits": (_ROUTER_LOGITS,),
    "pretraining_tp": (Irrelevant("transformers 5's DeepSeek does not read it", 2),),
    # what DeepSeek's own checkpoints write beside the class's fields
    "moe_layer_freq": (Refused(2),),
}

FAMILY["deepseek_v2"] = {
    **_MLA, "head_dim": (Irrelevant("transformers' DeepseekV2Config overwrites it with qk_rope_head_dim", double),), "mlp_bias": (Refused(True, match="mlp_bias true"),),
    "norm_topk_prob": (Irrelevant("transformers' DeepSeek-V2 router never renormalises", flip),),
    "topk_method": (Used("group_limited_greedy", {"n_group": 2, "topk_group": 1}), Refused("noaux_tc")),
    "n_group": (Irrelevant("read by group_limited_greedy routing only (greedy here)", 4),
                Used(4, {"topk_method": "group_limited_greedy", "topk_group": 1})),
    "topk_group": (Irrelevant("read by group_limited_greedy routing only (greedy here)", 2),
                   Used(1, {"topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2})),
    "scoring_func": (Refused("sigmoid"),),
}
FAMILY["deepseek_v3"] = {
    **_MLA, "head_dim": (Refused(double, match="head_dim 16 \\(qk_rope_head_dim 8\\)"),), "norm_topk_prob": (Used(flip),), "n_group": (Used(4),), "topk_group": (Used(2),),
    "rope_interleave": (Used(flip),),
    "num_nextn_predict_layers": (Irrelevant("the MTP layers: transformers' forward never runs them", 2),),
    "topk_method": (Refused("greedy"),), "scoring_func": (Refused("softmax"),),
}


def _treatments(family: str) -> dict[str, tuple[Treatment, ...]]:
    return {**COMMON, **FAMILY[family]}


def _config_class(family: str):
    import transformers

    return getattr(transformers, CLASSES[family])


def _base(family: str) -> dict[str, Any]:
    """A small config.json of the family as transformers 5 writes it."""
    config = _config_class(family)(**{**SHAPE, **MOE_SHAPE.get(family, {})}, architectures=[ARCH[family]])
    return config.to_dict()


def _with(raw: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    out = dict(raw)
    for key, value in changes.items():
        if value is DROP:
            out.pop(key, None)
        else:
            out[key] = value(raw.get(key)) if callable(value) else value
    return out


CASES = [(family, name, t) for family in CLASSES for name, ts in _treatments(family).items() for t in ts]


def test_every_field_of_every_family_class_is_sorted():
    unsorted = {family: sorted(set(_base(family)) - set(_treatments(family))) for family in CLASSES}
    assert not any(unsorted.values()), f"fields neither used, refused nor known irrelevant: {unsorted}"
    assert set(CLASSES) == set(ARCHITECTURES.values())


@pytest.mark.parametrize("family", list(CLASSES))
def test_defaults_are_transformers_class_defaults(family):
    """`DEFAULTS` (what an omitted field means) against the class's declared defaults."""
    cls = _config_class(family)
    declared = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    theta = cls.default_theta
    # no head_dim field (Qwen2, Qwen3-MoE): the modeling code's getattr(config, "head_dim", hidden // heads)
    expected = {"head_dim": None, **declared, "rope_theta": theta["global"] if isinstance(theta, dict) else theta}
    if family == "gemma3":
        expected.update(rope_local_base_freq=theta["local"], sliding_window_pattern=cls()._sliding_window_pattern)
    assert {k: expected.get(k, "(not a field)") for k in DEFAULTS[family]} == DEFAULTS[family]
    # Every field pdserve reads has its default in DEFAULTS, but those derived from others when omitted.
    derived = {"layer_types", "rope_parameters", "dtype", "architectures", "bos_token_id", "eos_token_id"}
    read = {name for name, ts in _treatments(family).items() if any(not isinstance(t, Irrelevant) for t in ts)}
    assert sorted((read & set(declared)) - set(DEFAULTS[family]) - derived) == []


@pytest.mark.parametrize("family, name, treatment", CASES, ids=[f"{f}-{n}-{type(t).__name__}" for f, n, t in CASES])
def test_each_field_is_treated_as_sorted(tmp_path, family, name, treatment):
    base = _with(_base(family), treatment.context)
    changed = _with(base, {name: treatment.probe})
    assert changed.get(name) != base.get(name), "the probe must change the field"
    if isinstance(treatment, Refused):
        with pytest.raises(ModelLoadError, match=treatment.match or name):
            parse_config(changed, tmp_path)
        return
    before, after = parse_config(base, tmp_path), parse_config(changed, tmp_path)
    if isinstance(treatment, Used):
        assert after != before, f"{family}'s {name} changes nothing pdserve computes"
    else:
        assert after == before, f"{family}'s {name} is irrelevant ({treatment.reason}), yet changes the ModelConfig"


IRRELEVANT = [(f, n, t) for f, n, t in CASES if isinstance(t, Irrelevant) and t.unchecked is None]

@functools.cache
def _hf_run(family: str, raw_json: str, weights_of: str | None = None):
    """(state dict, logits) of transformers' model of `raw_json`, with the weights of the model of
    `weights_of` (None: its own, seeded)."""
    import torch
    import transformers

    config = _config_class(family).from_dict(json.loads(raw_json))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if weights_of is not None:
        model.load_state_dict(_hf_run(family, weights_of)[0])
    with torch.no_grad():
        logits = model(torch.arange(3, 40)[None] % SHAPE["vocab_size"], use_cache=False).logits
    return model.state_dict(), logits


@pytest.mark.parametrize("family, name, treatment", IRRELEVANT, ids=[f"{f}-{n}" for f, n, _ in IRRELEVANT])
def test_an_irrelevant_field_leaves_transformers_logits_unchanged(family, name, treatment):
    """The reason checked: transformers' model of the family, the same weights, the field changed."""
    import torch

    base = _with(_base(family), treatment.context)
    changed = _with(base, {name: treatment.probe})
    before = json.dumps(base, sort_keys=True)
    after = _hf_run(family, json.dumps(changed, sort_keys=True), before)[1]
    assert torch.equal(_hf_run(family, before)[1], after), f"{family}'s {name} changes transformers' logits"


def test_transformers_gemma3_ignores_its_attention_softcap():
    """Why pdserve refuses Gemma 3's attn_logit_softcapping rather than apply it: transformers (and vLLM) compute
    Gemma 3 with no attention soft-cap whatever it says. Should transformers start applying it, this fails: then
    serve it (`ModelConfig.attn_softcap`, which both tiers compute) instead of refusing it."""
    import torch
    import transformers

    cls = _config_class("gemma3")
    base = _base("gemma3")
    ids = torch.arange(3, 40)[None] % SHAPE["vocab_size"]
    logits = []
    for cap in (None, 0.01):  # a cap far below the scores: applied, it would flatten every attention
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cls.from_dict(dict(base, attn_logit_softcapping=cap)),
                                                              dtype=torch.float32, attn_implementation="eager").eval()
        with torch.no_grad():
            logits.append(model(ids).logits)
    assert torch.equal(logits[0], logits[1])


OMITTED = [(family, name) for family in CLASSES for name in [*DEFAULTS[family], "layer_types", "rope_parameters"]]


@pytest.mark.parametrize("family, name", OMITTED, ids=[f"{f}-{n}" for f, n in OMITTED])
def test_an_omitted_field_means_what_transformers_reads_it_as(tmp_path, family, name):
    """config.json without the field: pdserve's reading equals its reading of what transformers makes of it
    (the class's config with that field's default, or derived from the others, written out in full)."""
    raw = _with(_base(family), {name: DROP})
    from huggingface_hub.errors import StrictDataclassError

    try:
        theirs = _config_class(family).from_dict(raw).to_dict()
        expected = parse_config(theirs, tmp_path)
    except (StrictDataclassError, ModelLoadError):  # transformers refuses it (26 layers by default, layer_types of
        with pytest.raises(ModelLoadError):  # 2), or pdserve what it makes of it (DeepSeek-V3's 128 kv heads of 4):
            parse_config(raw, tmp_path)  # so does pdserve the omission
        return
    assert parse_config(raw, tmp_path) == expected
