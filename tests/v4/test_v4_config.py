"""V4Config: read from transformers' own ``DeepseekV4Config`` (its defaults are DeepSeek-V4-Flash's shapes),
legacy keys, refusals naming the field, and the per-token cache cost the plan builds on."""

from __future__ import annotations

import json

import pytest

from flashdsa import v4
from flashdsa.v4 import CSA, HCA, SLIDING, V4Config


def test_flash_defaults_and_layer_pattern():
    c = V4Config.preset("v4-flash")
    assert (c.num_attention_heads, c.head_dim, c.rope_head_dim, c.sliding_window, c.index_topk) == (64, 512, 64, 128,
                                                                                                      512)
    assert c.layer_types[:4] == (HCA, HCA, HCA, CSA) and len(c.layer_types) == 43  # 2 HCA, then HCA / CSA
    assert c.softmax_scale == 512 ** -0.5
    assert [c.rate(i) for i in (0, 3)] == [128, 4]


def test_from_transformers_config():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV4Config"):
        pytest.skip("transformers without deepseek_v4")
    hf = transformers.DeepseekV4Config()
    c = V4Config.from_hf(hf.to_dict())
    assert c == V4Config.preset("v4-flash")
    small = transformers.DeepseekV4Config(num_hidden_layers=3, head_dim=64, qk_rope_head_dim=16, sliding_window=8,
                                          layer_types=[SLIDING, CSA, HCA], compress_rates={CSA: 4, HCA: 8},
                                          mlp_layer_types=["moe"] * 3, index_topk=4)
    c = V4Config.from_hf(small.to_dict())
    assert (c.layer_types, c.csa_rate, c.hca_rate, c.rope_head_dim, c.sliding_window, c.index_topk) == (
        (SLIDING, CSA, HCA), 4, 8, 16, 8, 4)


def test_legacy_keys_and_files(tmp_path):
    d = {"model_type": "deepseek_v4", "num_hidden_layers": 3, "compress_ratios": [0, 4, 128], "compress_rate_hca": 64,
         "qk_rope_head_dim": 32}
    c = V4Config.from_hf(d)
    assert c.layer_types == (SLIDING, CSA, HCA) and c.hca_rate == 64 and c.rope_head_dim == 32
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert V4Config.from_hf(str(tmp_path)) == c


@pytest.mark.parametrize("changes, field", [
    ({"model_type": "deepseek_v32"}, "model_type"),
    ({"compress_ratios": [0, 4, 5]}, "compress_ratios"),
    ({"layer_types": [SLIDING, CSA]}, "layer_types"),
    ({"layer_types": [SLIDING, CSA, "full_attention"]}, "layer_types"),
    ({"num_key_value_heads": 8}, "num_key_value_heads"),
    ({"head_dim": 1024}, "head_dim"),
    ({"o_groups": 3}, "o_groups"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"compress_rates": [4, 128]}, "compress_rates"),
])
def test_refusals_name_the_field(changes, field):
    d = dict({"model_type": "deepseek_v4", "num_hidden_layers": 3}, **changes)
    with pytest.raises(ValueError, match=f"^{field}:"):
        V4Config.from_hf(d)


def test_cache_cost_per_token():
    c = V4Config.preset("v4-flash")
    per = c.cache_bytes_per_token()
    assert per[SLIDING] == 0 and per[CSA] == (512 * 2 + 128 * 2) / 4 and per[HCA] == 512 * 2 / 128
    assert c.window_bytes() == 128 * 512 * 2
    # a CSA query at 1M context reads its window and index_topk entries; an HCA query every 128th token's entry
    assert c.selected_entries(3, 1 << 20) == 128 + 512 and c.selected_entries(0, 1 << 20) == 128 + 8192
    assert c.selected_entries(3, 100) == 100 + 25
    assert v4.is_v4({"architectures": ["DeepseekV4ForCausalLM"]}) and not v4.is_v4({"model_type": "deepseek_v32"})
