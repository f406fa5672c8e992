"""tba.plan on Llama-style decoders (RMSNorm, rotary, grouped-query attention, SwiGLU).

The estimate is validated against the bytes tba's cache measures (``cache.stats()``) on small
transformers-built Llama, Qwen2 and Mistral models with grouped-query attention: float32, bfloat16
weights, and float32 weights under bfloat16 autocast; SDPA (CPU's flash kernel), and eager
attention with and without dropout.
"""

from __future__ import annotations

import pytest
import torch

from tba import plan
from tests.plan.saved_bytes import cache_saved_bytes, count_saved_bytes

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

# 4 query heads share 2 key/value heads; ffn not a multiple of h; 2 layers.
TINY = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, ffn_size=176, seq_len=32, vocab_size=100)


def test_llama_layer_by_hand():
    # T = 3, h = 4, a = 2 heads of d = 2, one kv head (i_kv = 2), f = 6, V = 5, fp32, HF op-by-op norm, flash.
    shape = plan.ModelShape(arch="llama", num_layers=1, hidden_size=4, num_heads=2, num_kv_heads=1, ffn_size=6,
                            seq_len=3, vocab_size=5)
    acc = plan.Accounting.pytorch_cpu(dropout=False, attention="flash")
    T, h, i, i_kv, f, a, D = 3, 4, 4, 2, 6, 2, 4
    norm = T * h * 4 + T * 4 + T * h * D  # fp32 input copy, rstd, normalised
    attn = T * h * D + T * i * D + 2 * T * i_kv * D + a * T * 4 + T * i * D  # input, q, k, v, lse, o_proj input
    mlp = T * h * D + 4 * T * f * D  # input; gate, silu, up, down input
    model = 2 * 3 * 2 * D + T * 8 + norm + T * h * D + T * 5 * 4 + T * 8  # cos/sin, ids, final norm, head, loss
    assert (norm, attn, mlp, model) == (108, 216, 336, 312)
    assert plan.activation_bytes(shape, 1, acc) == 2 * norm + attn + mlp + model == 1080


def test_grouped_query_attention_terms():
    flash = plan.Accounting(include_head=False)
    eager = plan.Accounting(attention="eager", include_head=False)
    gqa = plan.ModelShape(arch="llama", **TINY)
    mha = plan.ModelShape(arch="llama", **{**TINY, "num_kv_heads": None})
    assert gqa.kv_width == 32 and mha.kv_width == 64
    k = {t.name: t for t in plan.activation_terms(gqa, 2, flash)}["layer.attn.k"]
    assert k.bytes_each == 2 * 32 * 32 * 2  # T * i_kv * D: the flash kernel reads grouped heads as they are
    eager_names = {t.name for t in plan.activation_terms(gqa, 2, eager)}
    assert {"layer.attn.k_repeated", "layer.attn.v_repeated", "layer.attn.softmax_output"} <= eager_names
    assert plan.activation_bytes(mha, 2, flash) - plan.activation_bytes(gqa, 2, flash) == 2 * 2 * (2 * 32 * 32 * 2)
    assert plan.activation_bytes(mha, 2, eager) == plan.activation_bytes(gqa, 2, eager)  # repeated to every head


def test_llama_defaults_and_validation():
    s = plan.ModelShape(arch="llama", num_layers=1, hidden_size=4096, num_heads=32, seq_len=8, vocab_size=10)
    assert s.ffn_size == 11008 and s.num_kv_heads == 32 and s.activation == "swiglu"  # Llama's 8h/3 rule
    with pytest.raises(ValueError) as e:
        plan.ModelShape(arch="llama", num_layers=1, hidden_size=64, num_heads=4, num_kv_heads=3, seq_len=8,
                        vocab_size=10, activation="gelu")
    assert "num_kv_heads" in str(e.value) and "swiglu" in str(e.value)
    with pytest.raises(ValueError, match="arch='llama' only"):
        plan.ModelShape(arch="gpt", num_layers=1, hidden_size=64, num_heads=4, num_kv_heads=2, seq_len=8,
                        vocab_size=10)


@pytest.mark.parametrize("name,params", [("llama3-8b", 8.03e9), ("llama3-70b", 70.55e9), ("llama2-7b", 6.74e9),
                                         ("mistral-7b", 7.24e9), ("qwen2.5-7b", 7.62e9), ("qwen2.5-72b", 72.7e9)])
def test_llm_presets_have_their_parameter_counts(name, params):
    # Published sizes (norms and biases omitted, < 0.1 %; Qwen2.5-0.5B ties its head, not counted here).
    assert plan.PRESETS[name].num_parameters == pytest.approx(params, rel=0.01)


def test_llama_flops_by_hand():
    s = plan.ModelShape(arch="llama", **TINY)
    b, T, h, i, i_kv, f, V, L = 3, 96, 64, 64, 32, 176, 100, 2
    fwd = L * (2 * T * h * (i + 2 * i_kv) + 2 * T * i * h + 4 * b * 32 * 32 * i + 2 * T * 3 * h * f) + 2 * T * h * V
    assert plan.model_flops(s, b) == 3 * fwd


def test_llama_recipe_is_the_default():
    r = plan.plan(plan.PRESETS["llama3-8b"], 1, step_time_s=1.0, drive=plan.DRIVES["optane-p5800x-1.6tb"])
    names = {t.name for t in r.terms}
    assert "layer.attn.logsumexp" in names and not any("softmax_output" in n or "dropout" in n for n in names)
    assert r.accounting.dtype_bytes == 2
    # 8192 tokens, per layer: 4*T*h*D (2 norm inputs, qkv and MLP inputs) + 2*T*i*D (q, o_proj input)
    # + 2*T*i_kv*D (k, v) + 4*T*f*D (SwiGLU) + a*T*4 (log-sum-exp) + 2*T*4 (rstd); plus the fp32 loss.
    T = 8192
    layer = (4 + 2) * T * 4096 * 2 + 2 * T * 1024 * 2 + 4 * T * 14336 * 2 + 32 * T * 4 + 2 * T * 4
    assert r.activation_bytes == pytest.approx(32 * layer + T * 128256 * 4, rel=0.01)


# ---- validation against tba's cache ----

def _hf_llm(arch: str, attention: str, dropout: float, dtype: torch.dtype):
    L, h, a, kv = TINY["num_layers"], TINY["hidden_size"], TINY["num_heads"], TINY["num_kv_heads"]
    common = dict(hidden_size=h, num_hidden_layers=L, num_attention_heads=a, num_key_value_heads=kv,
                  intermediate_size=TINY["ffn_size"], vocab_size=TINY["vocab_size"], max_position_embeddings=64,
                  attention_dropout=dropout, attn_implementation=attention, use_cache=False)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif arch == "mistral":  # Llama's block; its sliding window (4096) is longer than the sequence
        model = transformers.MistralForCausalLM(transformers.MistralConfig(**common))
    else:  # Qwen2: Llama's block with q/k/v biases (no saved-tensor difference)
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    return model.to(dtype).train()


@pytest.mark.parametrize("attention,dropout,dtype,autocast", [
    ("sdpa", 0.0, torch.float32, False), ("sdpa", 0.0, torch.bfloat16, False), ("sdpa", 0.0, torch.float32, True),
    ("eager", 0.1, torch.float32, False), ("eager", 0.0, torch.bfloat16, False)],
    ids=["sdpa-fp32", "sdpa-bf16-weights", "sdpa-autocast-bf16", "eager-dropout-fp32", "eager-bf16-weights"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_estimate_matches_cache(arch, attention, dropout, dtype, autocast):
    torch.manual_seed(0)
    model = _hf_llm(arch, attention, dropout, dtype)
    b = 3
    ids = torch.randint(0, TINY["vocab_size"], (b, TINY["seq_len"]))

    def loss() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return model(input_ids=ids, labels=ids).loss

    stats = cache_saved_bytes(model, loss)
    measured = stats.offloaded_bytes + stats.kept_bytes
    assert stats.offloaded_bytes > 0 and stats.num_cancelled == 0, stats
    storages, out = count_saved_bytes(model, loss)
    del out
    # The cache keys storages (and their version counter): if it holds more than the distinct
    # storages, a storage was saved through several tensor families. Report it; the planner
    # counts storages and is not bent to match.
    assert measured == storages.total_bytes, (
        f"the cache held {measured} B but the distinct saved storages are {storages.total_bytes} B; storages "
        f"saved through several tensor families: {storages.multi_family_storages or 'none found'}")
    acc = plan.Accounting.pytorch_cpu(dtype_bytes=2 if autocast else dtype.itemsize, dropout=dropout > 0,
                                      attention="flash" if attention == "sdpa" else "eager", autocast=autocast)
    estimate = plan.activation_bytes(plan.ModelShape(arch="llama", **TINY), b, acc)
    assert estimate == pytest.approx(measured, rel=0.01)


def test_autocast_counts_weight_casts():
    shape = plan.PRESETS["llama3-8b"]
    pure = plan.activation_terms(shape, 1, plan.Accounting())
    cast = {t.name: t for t in plan.activation_terms(shape, 1, plan.Accounting(autocast=True))}
    casts = sum(t.total_bytes for n, t in cast.items() if "weight_cast" in n)
    # every matmul weight once, at 2 bytes: all parameters but the (uncast) embedding table
    assert casts == 2 * (shape.num_parameters - shape.vocab_size * shape.hidden_size)
    assert cast["layer.attn_norm.input"].bytes_each == 8192 * 4096 * 4  # the residual stream stays fp32
    assert "layer.attn.qkv_input" in {t.name for t in pure} and "layer.attn.v_proj_input_cast" in cast
    with pytest.raises(ValueError, match="llama blocks with flash attention only"):
        plan.activation_bytes(plan.PRESETS["gpt2"], 1, plan.Accounting(autocast=True))
    with pytest.raises(ValueError, match="dtype_bytes must be 2"):
        plan.Accounting(autocast=True, dtype_bytes=4)
