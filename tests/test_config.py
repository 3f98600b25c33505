"""DSAConfig: presets, the skip-top-k rules (first match wins), kpool, from_hf sources, is_dsa, and
every ValueError (each must name the offending key)."""

from __future__ import annotations

import json
import math

import pytest

from flashdsa.config import DSA_ARCHITECTURES, PRESETS, DSAConfig, is_dsa


def _hf(**changes):
    """A minimal valid DSA config dict (V3.2 sizes, few layers) with ``changes`` applied; None deletes."""
    cfg = dict(
        architectures=["DeepseekV32ForCausalLM"], num_hidden_layers=8, hidden_size=7168,
        num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, index_n_heads=64, index_head_dim=128, index_topk=2048,
    )
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    return cfg


def _expected_skip(num_layers, freq, offset):
    """The docs/DSA.md §2 frequency rule written out independently of config.py."""
    skip = []
    for layer in range(num_layers):
        base = layer - 1 if offset is None else layer - offset + 1
        skip.append(max(base, 0) % freq != 0)
    return [i for i, s in enumerate(skip) if s]


# ---- presets ---------------------------------------------------------------------------------------

def test_preset_v32():
    c = DSAConfig.preset("v32")
    assert c.architectures == ("DeepseekV32ForCausalLM",)
    assert (c.num_hidden_layers, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank) == (61, 128, 1536, 512)
    assert (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (128, 64, 128)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk) == (64, 128, 2048)
    assert c.indexer_rope_interleave is False
    assert c.kv_cache_dim == 576 and c.qk_head_dim == 192 and c.page_size == 64
    assert c.skip_topk_layers == [] and c.topk_layers == list(range(61))
    # YaRN mscale: (0.1 * mscale_all_dim * ln(factor) + 1)^2 multiplies 192^-0.5.
    m = 0.1 * 1.0 * math.log(40) + 1.0
    assert c.softmax_scale == pytest.approx(192 ** -0.5 * m * m, rel=1e-12)
    assert is_dsa(PRESETS["v32"])


def test_preset_glm5():
    c = DSAConfig.preset("glm5")
    assert c.architectures == ("GlmMoeDsaForCausalLM",)
    assert (c.num_hidden_layers, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank) == (78, 64, 2048, 512)
    assert (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (192, 64, 256)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk) == (32, 128, 2048)
    assert c.indexer_rope_interleave is True
    assert c.kv_cache_dim == 576 and c.page_size == 64
    assert c.topk_layers == list(range(78))
    assert c.softmax_scale == pytest.approx(256 ** -0.5, rel=1e-12)  # no rope_scaling: plain 1/sqrt(192+64)


def test_preset_tiny():
    c = DSAConfig.preset("tiny")
    assert c.kv_cache_dim == 576 and c.index_head_dim == 128
    assert c.index_topk == 64 and c.num_hidden_layers == 4 and c.index_topk_freq == 2
    # freq 2 without offset: skip iff max(L - 1, 0) % 2 != 0 -> layers 2 skips.
    assert c.skip_topk_layers == _expected_skip(4, 2, None) == [2]
    assert c.topk_layers == [0, 1, 3]


def test_preset_unknown_name():
    with pytest.raises(ValueError, match="preset"):
        DSAConfig.preset("v4")


def test_presets_are_equal_to_their_dicts():
    for name, d in PRESETS.items():
        assert DSAConfig.preset(name) == DSAConfig.from_hf(d)


# ---- skip-top-k rules ------------------------------------------------------------------------------

def test_spec_example_78_layers_f4_o3():
    c = DSAConfig.from_hf(_hf(num_hidden_layers=78, index_topk_freq=4, index_skip_topk_offset=3))
    expect = [0, 1, 2] + list(range(6, 75, 4))
    assert c.topk_layers == expect
    assert len(c.topk_layers) == 21 and c.topk_layers[-1] == 74
    assert c.skip_topk_layers == sorted(set(range(78)) - set(expect))


@pytest.mark.parametrize("layers", [1, 2, 7, 61, 78])
@pytest.mark.parametrize("freq", [1, 2, 3, 4])
@pytest.mark.parametrize("offset", [None, 1, 2, 3, 5])
def test_freq_rule(layers, freq, offset):
    hf = _hf(num_hidden_layers=layers, index_topk_freq=freq, index_skip_topk_offset=offset)
    skip = _expected_skip(layers, freq, offset)
    if 0 in skip:  # offset 0 would make layer 0 skip; any offset here >= 1 keeps it computing
        pytest.fail("test table should not produce layer-0 skips")
    c = DSAConfig.from_hf(hf)
    assert c.skip_topk_layers == skip
    assert sorted(c.topk_layers + c.skip_topk_layers) == list(range(layers))


def test_freq_without_offset_equals_offset_2():
    a = DSAConfig.from_hf(_hf(num_hidden_layers=30, index_topk_freq=3))
    b = DSAConfig.from_hf(_hf(num_hidden_layers=30, index_topk_freq=3, index_skip_topk_offset=2))
    assert a.skip_topk_layers == b.skip_topk_layers == _expected_skip(30, 3, None)
    assert a.topk_layers[:4] == [0, 1, 4, 7]


def test_offset_alone_does_nothing():
    c = DSAConfig.from_hf(_hf(index_skip_topk_offset=3))
    assert c.skip_topk_layers == []


def test_indexer_types():
    types = ["full", "full", "shared", "full", "shared", "shared", "full", "shared"]
    c = DSAConfig.from_hf(_hf(indexer_types=types))
    assert c.indexer_types == tuple(types)
    assert c.skip_topk_layers == [2, 4, 5, 7]
    assert c.topk_layers == [0, 1, 3, 6]


def test_pattern_and_lowercase():
    c = DSAConfig.from_hf(_hf(index_topk_pattern="FFSFSSFS"))
    assert c.skip_topk_layers == [2, 4, 5, 7]
    c = DSAConfig.from_hf(_hf(index_topk_pattern="ffsfssfs"))
    assert c.skip_topk_layers == [2, 4, 5, 7]


def test_first_match_wins():
    types = ["full"] * 7 + ["shared"]
    pattern = "FSFFFFFF"
    # indexer_types beats pattern and freq
    c = DSAConfig.from_hf(_hf(indexer_types=types, index_topk_pattern=pattern, index_topk_freq=2))
    assert c.skip_topk_layers == [7]
    # pattern beats freq
    c = DSAConfig.from_hf(_hf(index_topk_pattern=pattern, index_topk_freq=2, index_skip_topk_offset=3))
    assert c.skip_topk_layers == [1]
    # freq alone
    c = DSAConfig.from_hf(_hf(index_topk_freq=2, index_skip_topk_offset=3))
    assert c.skip_topk_layers == _expected_skip(8, 2, 3) == [3, 5, 7]


def test_null_keys_are_absent():
    c = DSAConfig.from_hf(_hf(index_topk_freq=2) | {"indexer_types": None, "index_topk_pattern": None})
    assert c.indexer_types is None and c.index_topk_pattern is None
    assert c.skip_topk_layers == _expected_skip(8, 2, None)


# ---- kpool -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("c", [1, 2, 4, 8, 16, 32, 64])
def test_kpool_page_size(c):
    cfg = DSAConfig.from_hf(_hf(index_kpool=c))
    assert cfg.index_kpool == c and cfg.page_size == 64 * c


@pytest.mark.parametrize("c,topk", [(3, 2048), (128, 2048), (4, 2050), (6, 2046)])
def test_kpool_errors(c, topk):
    with pytest.raises(ValueError, match="index_kpool"):
        DSAConfig.from_hf(_hf(index_kpool=c, index_topk=topk))


def test_kpool_zero():
    with pytest.raises(ValueError, match="index_kpool"):
        DSAConfig.from_hf(_hf(index_kpool=0))


# ---- from_hf sources -------------------------------------------------------------------------------

def test_from_hf_dict_path_folder(tmp_path):
    d = _hf(index_topk_freq=4, index_skip_topk_offset=3, num_hidden_layers=78)
    (tmp_path / "config.json").write_text(json.dumps(d))
    a = DSAConfig.from_hf(d)
    b = DSAConfig.from_hf(tmp_path / "config.json")
    c = DSAConfig.from_hf(str(tmp_path / "config.json"))
    e = DSAConfig.from_hf(tmp_path)
    f = DSAConfig.from_hf(str(tmp_path))
    assert a == b == c == e == f
    assert len(e.topk_layers) == 21


def test_from_hf_ignores_unknown_keys_and_reads_optional():
    d = _hf(indexer_rope_interleave=True, model_type="deepseek_v32", torch_dtype="bfloat16", vocab_size=1000)
    c = DSAConfig.from_hf(d)
    assert c.indexer_rope_interleave is True and c.vocab_size == 1000


def test_from_hf_rope_parameters():
    c = DSAConfig.from_hf(_hf(rope_parameters={"rope_theta": 5e5, "rope_type": "default"}))
    assert c.rope_theta == 5e5 and c.rope_scaling is None
    yarn = {"rope_theta": 1e4, "rope_type": "yarn", "factor": 4.0, "mscale_all_dim": 1.0}
    c = DSAConfig.from_hf(_hf(rope_parameters=yarn))
    assert c.rope_scaling == yarn
    m = 0.1 * math.log(4.0) + 1.0
    assert c.softmax_scale == pytest.approx(192 ** -0.5 * m * m, rel=1e-12)


def test_replace_revalidates():
    c = DSAConfig.preset("tiny")
    assert c.replace(index_kpool=2).page_size == 128
    with pytest.raises(ValueError, match="index_kpool"):
        c.replace(index_kpool=3)


# ---- is_dsa ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", DSA_ARCHITECTURES)
def test_is_dsa_true(arch):
    assert is_dsa({"architectures": [arch], "index_topk": 2048})
    assert is_dsa({"architectures": ["LlamaForCausalLM", arch], "index_topk": 64})


@pytest.mark.parametrize("cfg", [
    {"architectures": ["DeepseekV3ForCausalLM"]},  # plain V3: no index_topk
    {"architectures": ["DeepseekV32ForCausalLM"], "index_topk": None},
    {"architectures": ["LlamaForCausalLM"], "index_topk": 2048},  # index_topk but not a DSA arch
    {"index_topk": 2048},
    {"architectures": None, "index_topk": 2048},
    {"architectures": [], "index_topk": 2048},
    {},
], ids=["v3-no-topk", "topk-null", "llama", "no-arch", "arch-null", "arch-empty", "empty"])
def test_is_dsa_false(cfg):
    assert not is_dsa(cfg)


# ---- every ValueError names its key ----------------------------------------------------------------

REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim")


def test_not_dsa_missing_index_topk():
    with pytest.raises(ValueError, match="index_topk"):
        DSAConfig.from_hf(_hf(index_topk=None))


def test_not_dsa_architecture():
    with pytest.raises(ValueError, match="architectures"):
        DSAConfig.from_hf(_hf(architectures=["LlamaForCausalLM"]))


@pytest.mark.parametrize("key", REQUIRED + ("q_lora_rank",))
def test_missing_key(key):
    with pytest.raises(ValueError, match=key):
        DSAConfig.from_hf(_hf(**{key: None}))


POSITIVE = tuple(k for k in REQUIRED if k != "qk_rope_head_dim") + (
    "q_lora_rank", "index_topk", "index_kpool", "vocab_size", "intermediate_size")


@pytest.mark.parametrize("bad", [-2, 3, 2.0, True, "8"], ids=["neg", "odd", "float", "bool", "str"])
def test_rope_head_dim(bad):
    """qk_rope_head_dim: an even integer >= 0; 0 is NoPE (GLM-5.3-Flash), which the caches store in their
    576-dim rows with a zero rope part."""
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        DSAConfig.preset("tiny").replace(qk_rope_head_dim=bad)
    assert DSAConfig.preset("tiny").replace(qk_rope_head_dim=0).kv_cache_dim == 512


@pytest.mark.parametrize("key", POSITIVE)
@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "8"], ids=["zero", "neg", "float", "bool", "str"])
def test_positive_int_keys(key, bad):
    with pytest.raises(ValueError, match=key):
        DSAConfig.from_hf(_hf(**{key: bad}))


@pytest.mark.parametrize("bad", [1, "true", 0])
def test_interleave_must_be_bool(bad):
    with pytest.raises(ValueError, match="indexer_rope_interleave"):
        DSAConfig.from_hf(_hf(indexer_rope_interleave=bad))
    with pytest.raises(ValueError, match="indexer_rope_interleave"):
        DSAConfig.preset("tiny").replace(indexer_rope_interleave=bad)


@pytest.mark.parametrize("dim", [64, 96, 192])
def test_index_head_dim(dim):
    with pytest.raises(ValueError, match="index_head_dim"):
        DSAConfig.from_hf(_hf(index_head_dim=dim))


def test_index_head_dim_256_ok():
    assert DSAConfig.from_hf(_hf(index_head_dim=256)).index_head_dim == 256


def test_indexer_types_errors():
    with pytest.raises(ValueError, match="indexer_types"):
        DSAConfig.from_hf(_hf(indexer_types=["full"] * 7))
    with pytest.raises(ValueError, match="indexer_types"):
        DSAConfig.from_hf(_hf(indexer_types=["full"] * 7 + ["dense"]))


def test_pattern_errors():
    with pytest.raises(ValueError, match="index_topk_pattern"):
        DSAConfig.from_hf(_hf(index_topk_pattern="FFFF"))
    with pytest.raises(ValueError, match="index_topk_pattern"):
        DSAConfig.from_hf(_hf(index_topk_pattern="FFFFFFFX"))


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_freq_errors(bad):
    with pytest.raises(ValueError, match="index_topk_freq"):
        DSAConfig.from_hf(_hf(index_topk_freq=bad))


@pytest.mark.parametrize("bad", [-1, 2.5])
def test_offset_errors(bad):
    with pytest.raises(ValueError, match="index_skip_topk_offset"):
        DSAConfig.from_hf(_hf(index_topk_freq=4, index_skip_topk_offset=bad))


@pytest.mark.parametrize("changes,key", [
    (dict(indexer_types=["shared"] + ["full"] * 7), "indexer_types"),
    (dict(index_topk_pattern="SFFFFFFF"), "index_topk_pattern"),
    (dict(index_topk_freq=4, index_skip_topk_offset=0), "index_topk_freq"),  # max(0 + 1, 0) % 4 != 0
], ids=["types", "pattern", "freq-offset0"])
def test_layer0_cannot_skip(changes, key):
    with pytest.raises(ValueError, match=key):
        DSAConfig.from_hf(_hf(**changes))


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        DSAConfig.from_hf(tmp_path / "nope")


@pytest.mark.parametrize("bad", [-1, 1.0, True, "2"])
def test_skip_offset_errors(bad):
    with pytest.raises(ValueError, match="index_skip_topk_offset"):
        DSAConfig.from_hf(_hf(index_topk_freq=2, index_skip_topk_offset=bad))


# ---- malformed sources and values (issue #15: no file name, TypeErrors) ------------------------------

@pytest.mark.parametrize("text,what", [
    ("{not json", "is not valid JSON"),
    ("", "is not valid JSON"),
    ("[1, 2]", "holds a JSON list"),
    ('"DeepseekV32ForCausalLM"', "holds a JSON str"),
])
def test_malformed_file_names_it(tmp_path, text, what):
    (tmp_path / "config.json").write_text(text)
    for source in (tmp_path, tmp_path / "config.json"):
        with pytest.raises(ValueError, match="config: .*config.json " + what):
            DSAConfig.from_hf(source)


def test_binary_file_names_it(tmp_path):
    (tmp_path / "config.json").write_bytes(bytes(range(128, 256)))
    with pytest.raises(ValueError, match="config: .*config.json is not valid JSON"):
        DSAConfig.from_hf(tmp_path)


@pytest.mark.parametrize("bad", [123, 1.5, ["config.json"], None])
def test_source_type(bad):
    with pytest.raises(ValueError, match="config: expected a dict, a path"):
        DSAConfig.from_hf(bad)


@pytest.mark.parametrize("key,bad", [
    ("architectures", "DeepseekV32ForCausalLM"), ("architectures", 3), ("indexer_types", "full"),
    ("indexer_types", 8), ("index_topk_pattern", ["F"] * 8), ("rope_theta", "1e4"), ("rope_theta", 0),
    ("rope_theta", float("nan")), ("rms_norm_eps", -1e-6), ("rms_norm_eps", True),
    ("max_position_embeddings", 0), ("max_position_embeddings", 4096.0), ("rope_scaling", "yarn"),
    ("rope_scaling", {"factor": "40", "mscale_all_dim": 1.0}),
])
def test_value_types(key, bad):
    with pytest.raises(ValueError, match=key):
        DSAConfig.from_hf(_hf(**{key: bad}))


def test_indexer_types_unhashable_entries():
    with pytest.raises(ValueError, match="indexer_types"):
        DSAConfig.from_hf(_hf(indexer_types=[["full"]] * 8))
