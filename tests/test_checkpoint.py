"""flashdsa.checkpoint: attention layers of a Hugging Face DeepSeek-V3.2 / GLM-5 checkpoint.

The checkpoints here are written in the published layout (config.json with quantization_config,
model.safetensors.index.json, shards holding whole layers; fp8 projections with block-128
``weight_scale_inv``, bf16 norms and ``weights_proj``) from a model whose weights are known, and the
loaded layers must equal that model's, bit for bit. The fp8 blocks are quantised and dequantised here
by loops over the blocks, not with the loader's code. HF's own ``save_pretrained`` checks the names
against transformers' modelling code. Then every error path.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import flashdsa.checkpoint as ck
from flashdsa.config import PRESETS, DSAConfig
from flashdsa.engine import DSAModel

CFG = DSAConfig.preset("tiny")   # 4 layers, layer 2 reuses layer 1's top-k
E4M3_MAX = 448.0
# As in DeepSeek's release: every projection in fp8 except the indexer's head gate.
FP8 = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "indexer.wq_b", "indexer.wk")
# The names of one top-k layer in DeepSeek-V3.2-Exp's model.safetensors.index.json (its attention part).
V32_LAYER_NAMES = {
    "input_layernorm.weight",
    "self_attn.q_a_proj.weight", "self_attn.q_a_proj.weight_scale_inv", "self_attn.q_a_layernorm.weight",
    "self_attn.q_b_proj.weight", "self_attn.q_b_proj.weight_scale_inv",
    "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_proj_with_mqa.weight_scale_inv",
    "self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight", "self_attn.kv_b_proj.weight_scale_inv",
    "self_attn.o_proj.weight", "self_attn.o_proj.weight_scale_inv",
    "self_attn.indexer.wq_b.weight", "self_attn.indexer.wq_b.weight_scale_inv",
    "self_attn.indexer.wk.weight", "self_attn.indexer.wk.weight_scale_inv",
    "self_attn.indexer.k_norm.weight", "self_attn.indexer.k_norm.bias", "self_attn.indexer.weights_proj.weight",
}


# ---- writing a checkpoint ----------------------------------------------------------------------------

def quantize_blocks(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``[R, C]`` float -> (``[R, C] e4m3``, ``[ceil(R/b), ceil(C/b)] f32``): per block, scale = amax / 448."""
    R, C = w.shape
    q = torch.empty(R, C, dtype=torch.float8_e4m3fn)
    s = torch.empty(-(-R // block), -(-C // block), dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * block:(i + 1) * block, j * block:(j + 1) * block].float()
            s[i, j] = blk.abs().max().clamp_min(1e-12) / E4M3_MAX
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (blk / s[i, j]).to(torch.float8_e4m3fn)
    return q, s


def dequant_blocks(q: torch.Tensor, s: torch.Tensor, block: int = 128) -> torch.Tensor:
    """The inverse of :func:`quantize_blocks`, block by block: ``[R, C] float32``."""
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            rows, cols = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            out[rows, cols] = q[rows, cols].float() * s[i, j].float()
    return out


def hf_state(model: DSAModel, fp8: bool = True) -> dict[str, torch.Tensor]:
    """The model's tensors under the HF names, stored as a release stores them; the model's own weights are
    set to what those tensors hold (bf16-rounded norms, dequantised fp8 projections), so loading must give
    them back exactly."""
    state = {"model.embed_tokens.weight": model.embed_tokens.weight.detach().bfloat16(),
             "model.norm.weight": model.norm.weight.detach().bfloat16(),
             "lm_head.weight": model.lm_head.weight.detach().bfloat16()}
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            p = f"model.layers.{i}."
            for name, param in layer.named_parameters():
                hf_name = p + name
                if fp8 and any(name == f"self_attn.{m}.weight" for m in FP8):
                    q, s = quantize_blocks(param)
                    state[hf_name], state[hf_name + "_scale_inv"] = q, s
                    param.copy_(dequant_blocks(q, s).to(param.dtype))
                else:
                    state[hf_name] = param.detach().bfloat16()
                    param.copy_(state[hf_name].to(param.dtype))   # what a bf16 checkpoint can hold
    return state


def write_checkpoint(root: Path, model: DSAModel, *, fp8: bool = True, config: dict | None = None,
                     drop: tuple[str, ...] = ()) -> dict[str, str]:
    """Write ``model`` as a sharded HF checkpoint: one shard for the embedding, one per layer, one for the
    final norm and LM head, ``model.safetensors.index.json`` and ``config.json``. Returns the weight map."""
    root.mkdir(parents=True, exist_ok=True)
    state = {k: v for k, v in hf_state(model, fp8).items() if k not in drop}
    L = model.config.num_hidden_layers
    n = L + 2

    def shard_of(name: str) -> int:
        if name.startswith("model.layers."):
            return 2 + int(name.split(".")[2])
        return 1 if "embed" in name else n

    weight_map = {k: f"model-{shard_of(k):05d}-of-{n:05d}.safetensors" for k in sorted(state)}
    for file in sorted(set(weight_map.values())):
        save_file({k: state[k].contiguous() for k, f in weight_map.items() if f == file}, str(root / file),
                  metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (root / ck.INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    hf = dict(PRESETS["tiny"], model_type="deepseek_v32", torch_dtype="bfloat16")
    if fp8:
        hf["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": [128, 128]}
    hf.update(config or {})
    (root / "config.json").write_text(json.dumps(hf))
    return weight_map


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A tiny model with known weights and its fp8 checkpoint."""
    model = DSAModel.random(CFG, seed=1)
    root = tmp_path_factory.mktemp("ckpt")
    wm = write_checkpoint(root, model)
    return model, root, wm


# ---- the layout and the loaded weights ---------------------------------------------------------------

def test_written_checkpoint_has_the_published_layout(written):
    from safetensors import safe_open

    _, root, wm = written
    for layer in (0, 1, 3):
        p = f"model.layers.{layer}."
        assert {k[len(p):] for k in wm if k.startswith(p) and ".mlp." not in k
                and "post_attention" not in k} == V32_LAYER_NAMES
    # the skip-top-k layer has no indexer tensors (as GLM's "shared" layers)
    assert not [k for k in wm if k.startswith("model.layers.2.self_attn.indexer")]
    with safe_open(str(root / wm["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]), "pt") as f:
        name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
        assert f.get_slice(name).get_dtype() == "F8_E4M3"
        assert f.get_slice(name + "_scale_inv").get_shape() == [5, 2]          # 576 x 256 in 128-blocks
        assert f.get_slice("model.layers.0.self_attn.indexer.weights_proj.weight").get_dtype() == "BF16"
        assert f.get_slice("model.layers.0.self_attn.indexer.k_norm.bias").get_dtype() == "BF16"


def test_loaded_layers_equal_the_model(written):
    model, root, _ = written
    loaded = ck.load_layers(root, "0-3")
    assert loaded.config == CFG and loaded.layers == [0, 1, 2, 3]
    for i, layer in enumerate(model.layers):
        attn = loaded.attention[i]
        assert attn.layer_id == i and not attn.training
        assert (attn.indexer is None) == (i in CFG.skip_topk_layers)
        got, want = dict(attn.named_parameters()), dict(layer.self_attn.named_parameters())
        assert set(got) == set(want)
        for name, p in want.items():
            assert not got[name].requires_grad
            # norms and the head gate in fp32; the projections in the model dtype
            fp32 = "norm" in name or "weights_proj" in name
            assert got[name].dtype == (torch.float32 if fp32 else torch.bfloat16), name
            assert torch.equal(got[name].float(), p.float()), f"layer {i} {name}"
        assert torch.equal(loaded.input_layernorm[i], layer.input_layernorm.weight)
        assert loaded.kpool[i] == {}


def test_load_dtype_float32_and_single_layer(written):
    model, root, _ = written
    loaded = ck.load_layers(root, 3, dtype=torch.float32)
    assert loaded.layers == [3]
    w = loaded.attention[3].q_b_proj.weight
    assert w.dtype == torch.float32
    # fp32 keeps the dequantised product unrounded: equal to the block loop's, and within bf16 rounding of the
    # model's (bf16) copy
    name = "model.layers.3.self_attn.q_b_proj.weight"
    from safetensors import safe_open

    with safe_open(str(root / "model-00005-of-00006.safetensors"), "pt") as f:
        want = dequant_blocks(f.get_tensor(name), f.get_tensor(name + "_scale_inv"))
    assert torch.equal(w, want)
    assert torch.equal(w.bfloat16(), model.layers[3].self_attn.q_b_proj.weight)


def test_only_the_needed_shards_are_opened(written, monkeypatch):
    import safetensors

    _, root, wm = written
    opened = []
    real = safetensors.safe_open

    def spy(path, *args, **kwargs):
        opened.append(Path(path).name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", spy)
    loaded = ck.load_layers(root, "1-2")
    want = {wm["model.layers.1.input_layernorm.weight"], wm["model.layers.2.input_layernorm.weight"]}
    assert set(opened) == want and set(loaded.shards) == want and len(opened) == 2


@pytest.mark.parametrize("band_bytes", [1, 8 * 200 * 128 * 2, None], ids=["band128", "band256", "one-band"])
@pytest.mark.parametrize("shape", [(300, 200), (128, 128), (1, 129), (576, 256)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_dequant_fp8_matches_the_block_loop(shape, band_bytes, monkeypatch):
    if band_bytes:   # bands of 1 or 2 block rows (at 200 columns)
        monkeypatch.setattr(ck, "_DEQUANT_BYTES", band_bytes)
    w = torch.randn(shape) * torch.logspace(-3, 2, shape[1])   # blocks of very different magnitudes
    q, s = quantize_blocks(w)
    assert torch.equal(ck.dequant_fp8(q, s, dtype=torch.float32), dequant_blocks(q, s))
    assert torch.equal(ck.dequant_fp8(q, s), dequant_blocks(q, s).bfloat16())
    # power-of-two (UE8M0) scales, as DeepSeek-V3.2 stores them
    s2 = torch.exp2(torch.randint(-12, 4, s.shape).float())
    assert torch.equal(ck.dequant_fp8(q, s2.to(torch.float8_e8m0fnu), dtype=torch.float32), dequant_blocks(q, s2))


def test_progress_line_on_stderr(written, capsys):
    _, root, _ = written
    ck.load_layers(root, "0-1", progress=True)
    err = capsys.readouterr().err
    assert "flashdsa: loading layers 0-1 from 2 shards" in err and "100.0%" in err and err.endswith("\n")
    ck.load_layers(root, "0-1", progress=False)
    assert capsys.readouterr().err == ""


def test_single_file_checkpoint(tmp_path):
    model = DSAModel.random(CFG, seed=2)
    state = hf_state(model, fp8=False)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(dict(PRESETS["tiny"], model_type="deepseek_v32")))
    loaded = ck.load_layers(tmp_path, "2-3")
    assert torch.equal(loaded.attention[3].kv_b_proj.weight, model.layers[3].self_attn.kv_b_proj.weight)
    assert loaded.shards == ("model.safetensors",)


def test_kpool_tensors_are_loaded_when_present(tmp_path):
    model = DSAModel.random(CFG, seed=3)
    write_checkpoint(tmp_path, model, config={"index_kpool": 4})
    gate, ape = torch.randn(128, CFG.hidden_size).bfloat16(), torch.randn(4, 128).bfloat16()
    p = "model.layers.0.self_attn.indexer.index_kpool_compress_"
    save_file({p + "gate": gate, p + "ape": ape}, str(tmp_path / "kpool.safetensors"))
    index = json.loads((tmp_path / ck.INDEX_FILE).read_text())
    index["weight_map"].update({p + "gate": "kpool.safetensors", p + "ape": "kpool.safetensors"})
    (tmp_path / ck.INDEX_FILE).write_text(json.dumps(index))
    loaded = ck.load_layers(tmp_path, "0")
    assert loaded.config.index_kpool == 4
    assert set(loaded.kpool[0]) == {"compress_gate", "compress_ape"}
    assert torch.equal(loaded.kpool[0]["compress_gate"], gate.float())
    assert torch.equal(loaded.kpool[0]["compress_ape"], ape.float())
    # the layer's indexer pools with them (kpool #19): the gate in the model dtype, the place term in fp32
    ind = loaded.attention[0].indexer
    assert torch.equal(ind.index_kpool_compress_gate, gate) and torch.equal(ind.index_kpool_compress_ape, ape.float())
    with pytest.raises(ValueError, match="layer 1 has no self_attn.indexer.index_kpool_compress_gate"):
        ck.load_layers(tmp_path, "0-1")  # layer 1 computes top-k but the checkpoint has no kpool tensors for it


# ---- against transformers' own modelling code ---------------------------------------------------------

@pytest.mark.parametrize("arch", ["v32", "glm"])
def test_hf_save_pretrained_checkpoint_loads(arch, tmp_path):
    pytest.importorskip("transformers")
    from test_hf import _tiny

    hf_model = _tiny(arch, seed=5)
    hf_model.save_pretrained(tmp_path, max_shard_size="300KB")
    assert (tmp_path / ck.INDEX_FILE).is_file()     # sharded, as the releases are
    n = hf_model.config.num_hidden_layers
    loaded = ck.load_layers(tmp_path, f"0-{n - 1}", dtype=torch.float32)
    for i, layer in enumerate(hf_model.model.layers):
        hf_attn, attn = layer.self_attn, loaded.attention[i]
        assert (attn.indexer is None) == (getattr(hf_attn, "indexer", None) is None)
        for name, p in attn.named_parameters():
            want = hf_attn.get_parameter(name)
            assert torch.equal(p, want.float()), f"layer {i} {name}"
        assert torch.equal(loaded.input_layernorm[i], layer.input_layernorm.weight.float())
        assert attn.softmax_scale == pytest.approx(hf_attn.scaling, rel=1e-12)


# ---- errors ------------------------------------------------------------------------------------------

@pytest.fixture
def copy(written, tmp_path):
    """A writable copy of the written checkpoint."""
    import shutil

    _, root, _ = written
    dst = tmp_path / "ckpt"
    shutil.copytree(root, dst)
    return dst


def _edit_json(path: Path, edit) -> None:
    d = json.loads(path.read_text())
    edit(d)
    path.write_text(json.dumps(d))


def test_missing_shard_names_it(copy, written):
    _, _, wm = written
    shard = wm["model.layers.1.self_attn.q_a_proj.weight"]
    (copy / shard).unlink()
    ck.load_layers(copy, "2-3")      # not needed: fine
    with pytest.raises(FileNotFoundError, match=rf"shard .*{shard} is missing .*model\.layers\.1\."):
        ck.load_layers(copy, "0-1")


def test_missing_tensor_names_it(copy):
    name = "model.layers.1.self_attn.indexer.wk.weight"
    _edit_json(copy / ck.INDEX_FILE, lambda d: d["weight_map"].pop(name))
    with pytest.raises(ValueError, match=rf"tensor '{name}' is not in"):
        ck.load_layers(copy, "1")


def test_index_pointing_to_the_wrong_shard(copy, written):
    _, _, wm = written
    name = "model.layers.0.self_attn.o_proj.weight"
    wrong = wm["model.layers.1.self_attn.o_proj.weight"]
    _edit_json(copy / ck.INDEX_FILE, lambda d: d["weight_map"].__setitem__(name, wrong))
    with pytest.raises(ValueError, match=rf"puts '{name}' in {wrong}, which does not hold it"):
        ck.load_layers(copy, "0")


def test_shape_that_does_not_match_the_config(copy):
    _edit_json(copy / "config.json", lambda d: d.__setitem__("num_attention_heads", 8))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_b_proj\.weight: expected shape \[768, 96\] "
                                         r"from config\.json, got \[384, 96\]"):
        ck.load_layers(copy, "0")


def test_scale_shape_and_missing_scale(copy, written):
    _, _, wm = written
    name = "model.layers.0.self_attn.o_proj.weight"
    shard = copy / wm[name]
    from safetensors.torch import load_file

    tensors = load_file(str(shard))
    tensors[name + "_scale_inv"] = torch.ones(3, 3)
    save_file(tensors, str(shard))
    with pytest.raises(ValueError, match=r"o_proj\.weight_scale_inv: expected shape \[2, 1\] .* got \[3, 3\]"):
        ck.load_layers(copy, "0")
    del tensors[name + "_scale_inv"]
    save_file(tensors, str(shard))
    _edit_json(copy / ck.INDEX_FILE, lambda d: d["weight_map"].pop(name + "_scale_inv"))
    with pytest.raises(ValueError, match=r"o_proj\.weight is F8_E4M3 but .*weight_scale_inv' is missing"):
        ck.load_layers(copy, "0")


def test_not_a_dsa_checkpoint(copy):
    _edit_json(copy / "config.json", lambda d: d.pop("index_topk"))
    with pytest.raises(ValueError, match=r"checkpoint: .* is not a DSA checkpoint .*index_topk: missing"):
        ck.load_layers(copy, "0")
    _edit_json(copy / "config.json", lambda d: d.update(index_topk=64, architectures=["LlamaForCausalLM"],
                                                        model_type="llama"))
    with pytest.raises(ValueError, match=r"not a DSA checkpoint .*architectures: expected one of"):
        ck.load_layers(copy, "0")


def test_missing_files(copy, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"checkpoint: .*nowhere is not a folder"):
        ck.load_layers(tmp_path / "nowhere", "0")
    (copy / ck.INDEX_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=r"has neither model\.safetensors\.index\.json nor model\.safetensors"):
        ck.load_layers(copy, "0")
    (copy / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json is missing"):
        ck.load_layers(copy, "0")


def test_unsupported_quantization_and_bias(copy):
    _edit_json(copy / "config.json", lambda d: d["quantization_config"].update(quant_method="awq"))
    with pytest.raises(ValueError, match=r"quant_method 'awq' is not supported"):
        ck.load_layers(copy, "0")
    _edit_json(copy / "config.json", lambda d: (d.pop("quantization_config"), d.update(attention_bias=True)))
    with pytest.raises(ValueError, match=r"attention_bias is true"):
        ck.load_layers(copy, "0")


@pytest.mark.parametrize("spec", ["4", "0-4", "2-1", "a-b", "1-2-3", "", [], [0, True], -1, 1.5])
def test_bad_layers(written, spec):
    _, root, _ = written
    with pytest.raises(ValueError, match=r"^layers: expected"):
        ck.load_layers(root, spec)


def test_parse_layers():
    assert ck.parse_layers("1-3", 4) == [1, 2, 3]
    assert ck.parse_layers(" 2 ", 4) == [2]
    assert ck.parse_layers([3, 1, 1], 4) == [1, 3]
    assert ck.parse_layers(0, 4) == [0]


@pytest.mark.parametrize("damage", ["empty", "truncated", "not safetensors"])
def test_a_damaged_shard_is_named(copy, written, damage):
    _, _, wm = written
    shard = copy / wm["model.layers.1.self_attn.q_a_proj.weight"]
    data = shard.read_bytes()
    bad = {"empty": b"", "truncated": data[: len(data) // 2], "not safetensors": b"<html>404</html>"}
    shard.write_bytes(bad[damage])
    ck.load_layers(copy, "2-3")      # not needed: fine
    with pytest.raises(ValueError, match=rf"^checkpoint: {shard} is not a readable safetensors file \(.*\); is it "
                                         r"truncated or corrupt\?"):
        ck.load_layers(copy, "0-1")


def test_a_single_file_that_is_not_safetensors_is_named(tmp_path):
    (tmp_path / ck.SINGLE_FILE).write_bytes(b"")
    with pytest.raises(ValueError, match=r"^checkpoint: .*model\.safetensors is not a readable safetensors file"):
        ck.weight_map(tmp_path)


@pytest.mark.parametrize("name", ["self_attn.q_a_proj.weight", "self_attn.kv_a_layernorm.weight",
                                  "self_attn.q_a_proj.weight_scale_inv"])
def test_non_finite_weights_are_named(copy, written, name):
    """A NaN weight (or scale) would give plausible-looking figures downstream: refused, naming the tensor and shard."""
    from safetensors.torch import load_file

    _, _, wm = written
    full = "model.layers.1." + name
    shard = copy / wm[full]
    tensors = load_file(str(shard))
    t = tensors[full]
    if t.dtype == torch.float8_e4m3fn:
        t.view(torch.uint8).fill_(0x7F)  # e4m3's NaN code
    else:
        t[0] = float("nan")
    save_file(tensors, str(shard))
    weight = full.removesuffix("_scale_inv")
    with pytest.raises(ValueError, match=rf"^checkpoint: {weight} in {wm[full]} holds \d+ non-finite value"):
        ck.load_layers(copy, "1")


def test_glm5_next_save_pretrained_checkpoint_loads(tmp_path):
    """GLM-5.3-Flash (transformers glm5_next): the language model's tensors under ``model.language_model.``,
    a hybrid stack whose DSA layers are what the loader reads (NoPE rows, kpool 16, a shared layer without an
    indexer), and a linear-attention layer refused by name."""
    pytest.importorskip("transformers", minversion="5.23")
    pytest.importorskip("transformers.models.glm5_next")
    from test_hf_glm5_next import DSA_LAYERS, _model

    hf_model = _model(seed=3)
    hf_model.save_pretrained(tmp_path, max_shard_size="2MB")
    loaded = ck.load_layers(tmp_path, DSA_LAYERS, dtype=torch.float32)
    assert loaded.layers == DSA_LAYERS and loaded.config.qk_rope_head_dim == 0
    text = hf_model.model.language_model
    for i in DSA_LAYERS:
        hf_attn, attn = text.layers[i].self_attn, loaded.attention[i]
        assert (attn.indexer is None) == (getattr(hf_attn, "indexer", None) is None), i
        for name, p in attn.named_parameters():
            assert torch.equal(p, hf_attn.get_parameter(name).float()), f"layer {i} {name}"
        assert torch.equal(loaded.input_layernorm[i], text.layers[i].input_layernorm.weight.float())
    with pytest.raises(ValueError, match="layers: layer 0 is a linear_attention layer"):
        ck.load_layers(tmp_path, "0-1")
