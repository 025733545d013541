"""attn_implementation="attnlib" in Hugging Face transformers models built from tiny configs with
random weights (nothing downloaded): the logits of a padded batch (left and right padding) keep
the accuracy rule against the model in float64 (``max|attnlib - ref64| <= 2 * max|eager32 -
ref64| + 1e-5`` over the tokens that are not padding; ref64's attention is the plain float64
formula below, as transformers' eager softmax runs in float32), and greedy generation of 32
tokens from a left-padded batch gives eager's tokens. Families: Llama (GQA, RoPE, causal),
Mistral (sliding window), Gemma 2 (softcapping, sliding and global layers), gpt-oss (attention
sinks), BERT (bidirectional encoder). CI installs transformers (.ci/run) and runs
them; without the `[transformers]` extra they skip."""

# ruff: noqa: E402  (the optional packages are asked for before the imports that need them)
from __future__ import annotations

import pytest

# optional: the `[transformers]` extra (CI installs it); without it these skip
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import attnlib
import attnlib.integrations.transformers as attnlib_hf
from attnlib.testing.tolerance import assert_rule

VOCAB, PAD = 97, 0
_DECODER = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                pad_token_id=PAD)


def _families():
    t = transformers
    yield "llama", t.LlamaForCausalLM, t.LlamaConfig(**_DECODER)
    yield "mistral", t.MistralForCausalLM, t.MistralConfig(sliding_window=6, **_DECODER)
    yield "gemma2", t.Gemma2ForCausalLM, t.Gemma2Config(
        head_dim=16, sliding_window=5, attn_logit_softcapping=3.0, final_logit_softcapping=None,
        query_pre_attn_scalar=20, **_DECODER)
    yield "gpt_oss", t.GptOssForCausalLM, t.GptOssConfig(
        head_dim=16, sliding_window=6, num_local_experts=4, num_experts_per_tok=2, **_DECODER)
    yield "bert", t.BertForMaskedLM, t.BertConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, pad_token_id=PAD)


FAMILIES = {name: (cls, cfg) for name, cls, cfg in _families()}


def _ref64(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
           is_causal=None, **kwargs):
    """Attention in float64 as transformers' eager computes it (scores, softcap, mask, softmax),
    without its float32 softmax; a row with no visible key gives 0."""
    rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    s = query.double() @ key.double().transpose(2, 3) * scaling
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if attention_mask is None and (is_causal if is_causal is not None else module.is_causal):
        sq, sk = s.shape[-2:]
        attention_mask = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
    if attention_mask is not None:
        s = s.masked_fill(~attention_mask, -torch.inf) if attention_mask.dtype == torch.bool \
            else s + attention_mask
    sinks = kwargs.get("s_aux")
    if sinks is not None:  # gpt-oss: one more logit per head, of a zero value
        column = sinks.double().reshape(1, -1, 1, 1).expand(*s.shape[:3], 1)
        p = torch.softmax(torch.cat([s, column], -1), -1)[..., :-1]
    else:
        p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p @ value.double()).to(query.dtype).transpose(1, 2).contiguous(), None


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # tiny matrices: torch's thread pool only adds waiting on a shared CPU
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    attnlib_hf.register()
    transformers.AttentionInterface.register("ref64", _ref64)
    AttentionMaskInterface.register("ref64", sdpa_mask)
    yield
    torch.set_num_threads(threads)


def _batch(gen, length, pads, left):
    ids = torch.randint(1, VOCAB, (len(pads), length), generator=gen)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        if pad:
            sl = slice(0, pad) if left else slice(length - pad, length)
            ids[row, sl], mask[row, sl] = PAD, 0
    return ids, mask


def _logits(model, impl, ids, mask):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_and_generation(family):
    cls, cfg = FAMILIES[family]
    torch.manual_seed(31)
    model = cls(cfg).eval()
    model64 = cls(cfg).eval().to(torch.float64)
    if family == "gpt_oss":  # its default grouped matmul of the experts has no float64
        model64.set_experts_implementation("eager")
    model64.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(32)
    for left in (True, False):
        ids, mask = _batch(gen, 19, (4, 0, 7), left)
        keep = mask.bool()
        got = _logits(model, "attnlib", ids, mask)[keep]
        naive = _logits(model, "eager", ids, mask)[keep]
        ref = _logits(model64, "ref64", ids, mask)[keep]
        assert_rule(got.numpy(), ref.numpy(), naive.numpy(), what=f"{family} logits")
    if family == "bert":
        return
    ids, mask = _batch(gen, 11, (3, 0), left=True)
    tokens = {}
    for impl in ("eager", "attnlib"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            tokens[impl] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=32,
                                          min_new_tokens=32, do_sample=False, pad_token_id=PAD)
    assert tokens["attnlib"].shape == (2, 11 + 32)
    assert torch.equal(tokens["attnlib"], tokens["eager"])


def test_static_cache_generation():
    """A static cache's prefill: transformers passes no mask and keys past the prompt are free
    slots (SDPA's top-left is_causal); the tokens must still be eager's."""
    cls, cfg = FAMILIES["llama"]
    torch.manual_seed(34)
    model = cls(cfg).eval()
    ids = torch.randint(1, VOCAB, (1, 9), generator=torch.Generator().manual_seed(35))
    tokens = {}
    for impl in ("eager", "attnlib"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            tokens[impl] = model.generate(input_ids=ids, max_new_tokens=6, min_new_tokens=6,
                                          do_sample=False, cache_implementation="static")
    assert torch.equal(tokens["attnlib"], tokens["eager"])


def test_attnlib_is_called(monkeypatch):
    """The model's layers reach attnlib (not a fallback): count the calls."""
    cls, cfg = FAMILIES["llama"]
    model = cls(cfg).eval()
    calls = []
    forward = attnlib_hf.attention_forward
    monkeypatch.setattr(transformers.AttentionInterface, "_global_mapping", dict(
        transformers.AttentionInterface._global_mapping,
        attnlib=lambda *a, **k: calls.append(1) or forward(*a, **k)))
    ids, mask = _batch(torch.Generator().manual_seed(33), 5, (1, 0), left=True)
    _logits(model, "attnlib", ids, mask)
    assert len(calls) == cfg.num_hidden_layers


def test_layer_compiles_without_graph_break():
    """Under torch.compile a layer's call is the custom op: one graph, no break, same numbers."""
    cls, cfg = FAMILIES["mistral"]
    layer = cls(cfg).eval().model.layers[0].self_attn
    q, k = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 7, 16)
    mask = torch.rand(2, 1, 5, 7) < 0.8

    def fn(q, k, mask):
        return attnlib_hf.attention_forward(layer, q, k, k + 1.0, mask, scaling=0.3)[0]

    explained = torch._dynamo.explain(fn)(q, k, mask)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(q, k, mask), fn(q, k, mask))


def test_refusals():
    cls, cfg = FAMILIES["llama"]
    model = cls(cfg)  # training mode: dropout is given as attention_dropout (0.0 here)
    q = torch.randn(1, 4, 3, 16)
    with pytest.raises(attnlib.UnsupportedError, match="dropout"):
        attnlib_hf.attention_forward(model.model.layers[0].self_attn, q, q, q, None, dropout=0.1)
    model.set_attn_implementation("attnlib")
    with pytest.raises(attnlib.UnsupportedError, match="no_grad"):
        model(input_ids=torch.ones(1, 3, dtype=torch.long))  # gradients enabled
