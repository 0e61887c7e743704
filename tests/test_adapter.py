"""mecefo.adapter: the neighbour techniques applied by module name to a model we do not own. On transformers'
LlamaForCausalLM (built from a config, no download) with our GPT's weights mapped in, every technique subset
gives our GPT's neighbour loss and gradients; normal mode is the model's own, bit for bit; the techniques'
properties hold on the adapted model."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from mecefo.adapter import LAYOUTS, Adapter, Layout
from mecefo.model import GPT, preset
from mecefo.neighbour import TECHNIQUES, LowRankWgrad, Neighbour, Techniques

transformers = pytest.importorskip("transformers")

CFG = preset("nano")
SUBSETS = [Techniques(**dict(zip(TECHNIQUES, bits))) for bits in itertools.product((False, True), repeat=len(TECHNIQUES))]


def llama_twin(gpt: GPT):
    """A LlamaForCausalLM of the GPT's shape holding its weights (our names mapped to transformers')."""
    c = gpt.cfg
    config = transformers.LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.ffn_dim,
                                      num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
                                      num_key_value_heads=c.n_heads, max_position_embeddings=c.max_seq_len,
                                      rms_norm_eps=c.norm_eps, tie_word_embeddings=False, attention_bias=False,
                                      mlp_bias=False, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict({hf_name(k): v for k, v in gpt.state_dict().items()}, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return model


def hf_name(ours: str) -> str:
    """Our GPT's parameter name as transformers' Llama names it."""
    parts = ours.split(".")
    if parts[0] == "layers":
        parts[2] = {"attention": "self_attn", "attention_norm": "input_layernorm", "ffn": "mlp",
                    "ffn_norm": "post_attention_layernorm"}[parts[2]]
        return "model." + ".".join(parts)
    return {"embedding.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}.get(ours, ours)


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, CFG.vocab_size, (3, 16), generator=g)
    return x, torch.roll(x, -1, dims=1)


def ours(gpt, t, x, y):
    gpt.zero_grad(set_to_none=True)
    lowrank = LowRankWgrad(r=4, svd="exact").bind(gpt)
    loss = gpt(x, y, neighbour=Neighbour(t, lowrank) if t != Techniques() else None)
    loss.backward()
    lowrank.finish()
    return loss.item(), {hf_name(k): p.grad for k, p in gpt.named_parameters()}


def adapted(model, t, x, y, layout="llama"):
    model.zero_grad(set_to_none=True)
    lowrank = LowRankWgrad(r=4, svd="exact").bind(model)
    adapter = Adapter(model, layout)
    with adapter.neighbour(Neighbour(t, lowrank) if t != Techniques() else None):
        out = model(x)
        logits = out.logits if hasattr(out, "logits") else out
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()  # after the block: the techniques' backward needs none of it
    lowrank.finish()
    return loss.item(), {k: p.grad for k, p in model.named_parameters()}


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    gpt = GPT(CFG)
    return gpt, llama_twin(gpt)


@pytest.mark.parametrize("t", SUBSETS, ids=lambda t: t.names)
def test_every_technique_subset_on_llama_equals_our_gpts_neighbour(models, t):
    """Loss within 1e-6 and every gradient within 1e-5 (absolute, on gradients of order 1e-2) of our GPT's."""
    gpt, llama = models
    x, y = batch()
    loss_a, grads_a = ours(gpt, t, x, y)
    loss_b, grads_b = adapted(llama, t, x, y)
    assert loss_b == pytest.approx(loss_a, rel=1e-6)
    assert set(grads_a) == set(grads_b)
    for name, ga in grads_a.items():
        gb = grads_b[name]
        assert (ga is None) == (gb is None), name
        if ga is not None:
            torch.testing.assert_close(gb, ga, atol=1e-5, rtol=1e-4, msg=name)


def test_the_mecefo_layout_on_our_gpt_is_its_own_neighbour_mode(models):
    """The adapter on our GPT (normal-mode code, techniques by module name) against its own neighbour mode."""
    gpt, _ = models
    x, y = batch(1)
    for t in SUBSETS:
        loss_a, grads_a = ours(gpt, t, x, y)
        loss_b, grads_b = adapted(gpt, t, x, y, layout="mecefo")
        assert loss_b == pytest.approx(loss_a, rel=1e-6), t.names
        for name, gb in grads_b.items():
            ga = grads_a[hf_name(name)]
            assert (ga is None) == (gb is None), (t.names, name)
            if ga is not None:
                torch.testing.assert_close(gb, ga, atol=1e-6, rtol=1e-5, msg=f"{t.names} {name}")


def test_normal_mode_is_the_models_own_forward_and_gradients_bit_for_bit(models):
    _, llama = models
    x, y = batch(2)

    def plain():
        llama.zero_grad(set_to_none=True)
        loss = F.cross_entropy(llama(x).logits.float().view(-1, CFG.vocab_size), y.reshape(-1))
        loss.backward()
        return loss.item(), {k: p.grad.clone() for k, p in llama.named_parameters()}

    before = plain()
    with Adapter(llama, "llama").neighbour(Neighbour(Techniques.parse("mecefo"), LowRankWgrad(r=4))):
        llama(x)  # a neighbour's forward, then normal mode again
    assert not any("forward" in m.__dict__ for m in llama.modules())  # nothing left on any instance
    for loss_grads in (plain(), adapted(llama, Techniques(), x, y)):
        assert loss_grads[0] == before[0]
        assert all(torch.equal(loss_grads[1][k], before[1][k]) for k in before[1])


def test_on_the_adapted_model_attention_gets_no_gradient_and_low_rank_touches_only_ffn_weights(models):
    _, llama = models
    x, y = batch(3)
    adapter = Adapter(llama, "llama")
    _, normal = adapted(llama, Techniques(), x, y)
    _, skipped = adapted(llama, Techniques(skip_attention=True), x, y)
    for k, g in skipped.items():
        assert (g is None) == (adapter.group_of(k).startswith("attention")), k  # attention and its norm: none
    lowrank = LowRankWgrad(r=4, svd="exact").bind(llama)
    llama.zero_grad(set_to_none=True)
    with adapter.neighbour(Neighbour(Techniques(low_rank_wgrad=True), lowrank)):
        loss = F.cross_entropy(llama(x).logits.float().view(-1, CFG.vocab_size), y.reshape(-1))
    loss.backward()
    lowrank.finish()
    ffn = {id(m.weight) for m in adapter.ffn_linears()}
    for k, p in llama.named_parameters():
        if id(p) in ffn:  # the exact gradient projected on span(V1): G V1 V1^T
            v1 = lowrank.basis(llama.get_submodule(k.rsplit(".", 1)[0]))
            torch.testing.assert_close(p.grad, normal[k] @ v1 @ v1.T, atol=1e-6, rtol=1e-4)
        else:  # the input gradients are exact: every other parameter's gradient is normal mode's
            torch.testing.assert_close(p.grad, normal[k], atol=1e-7, rtol=1e-5, msg=k)


def test_groups_by_module_name_match_ours(models):
    gpt, llama = models
    from mecefo.model import group_of

    adapter = Adapter(llama, "llama")
    assert {hf_name(k): group_of(k) for k, _ in gpt.named_parameters()} == \
        {k: adapter.group_of(k) for k, _ in llama.named_parameters()}


def test_a_layout_that_names_missing_modules_is_refused(models):
    _, llama = models
    with pytest.raises(ValueError, match="no module the layout names"):
        Adapter(llama, Layout("model.layers", "attn", "mlp", ("gate_proj",), "lm_head", "input_layernorm", "x"))
    with pytest.raises(ValueError, match="presets: mecefo, llama"):
        Adapter(llama, "gpt2")
    assert set(LAYOUTS) >= {"mecefo", "llama", "mistral", "qwen2"}
