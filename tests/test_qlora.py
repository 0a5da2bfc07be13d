"""QLoRA on the CPU (bitsandbytes' CPU backend): the LoRA gradients of a 4-bit (nf4) model, computed by the trainer's
own update path, equal those of the same model whose linear weights are the dequantized 4-bit values in fp32; and a
2-step QLoRA run.

The case that used to fail: on a CPU with avx512_bf16, a 4-bit layer that runs once in eval mode without gradients
(sampling, evaluation) repacks its weights for bitsandbytes' `gemv_4bit` kernel, which has no backward, and keeps them
so; every later forward, the update's included, then took that kernel, torch warned "bitsandbytes::gemv_4bit: an
autograd kernel was not registered", and no gradient flowed through the base weights into the layers below: the
adapter's gradients were wrong. `models.keep_4bit_differentiable` (applied by `load_policy`) turns the repacking off.

Tolerance: both models compute in fp32 here (autocast off, bnb_4bit_compute_dtype float32), so the only difference is
where the 4-bit weights are dequantized: max |g_4bit - g_dequantized| / max |g_dequantized| < 1e-4 per parameter.
Without the fix the first case measured 0.937 for layer 0's q_proj lora_A (the gradient through the base weights
missing)."""
import pytest, torch
from mmrgrpo.config import load_config
from mmrgrpo.models import load_policy, tiny_random_model
from mmrgrpo.sampling import HFBackend
from mmrgrpo.step import update

pytest.importorskip("bitsandbytes", reason="QLoRA needs bitsandbytes")
B, G = 2, 4


class GradCapture:
    "Stands in for the optimizer: keeps the gradients `update` would apply and moves nothing."
    def __init__(self, named): self.named, self.grads = dict(named), None
    def zero_grad(self, set_to_none=True):
        for p in self.named.values(): p.grad = None
    def step(self): self.grads = {n: p.grad.detach().clone() for n, p in self.named.items()}


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory, tokenizer):
    "A tiny random Llama saved as a model folder (so that `load_policy` can load it in 4 bits)."
    out = tmp_path_factory.mktemp("tiny4bit")
    tiny_random_model(tokenizer, seed=0).save_pretrained(out); tokenizer.save_pretrained(out)
    return str(out)


def dequantized_twin(q_model, c):
    "The same model in fp32 with plain linear layers holding the dequantized 4-bit weights, and the same adapter."
    import bitsandbytes as bnb
    from bitsandbytes.functional import dequantize_4bit
    d_model, _ = load_policy(load_config(**{**vars(c), "load_in_4bit": False}))
    plain = dict(d_model.named_modules())
    for name, m in q_model.named_modules():
        if isinstance(m, bnb.nn.Linear4bit):
            assert not getattr(m.weight.quant_state, "packing_format_for_cpu", False)
            plain[name].weight.data = dequantize_4bit(m.weight.data, m.weight.quant_state).float()
    d_model.load_state_dict({n: p for n, p in q_model.state_dict().items() if "lora_" in n}, strict=False)
    return d_model


def lora_grads(model, rollout, adv, c) -> dict:
    opt = GradCapture((n, p) for n, p in model.named_parameters() if p.requires_grad)
    update(model, opt, rollout, adv, c)
    return opt.grads


@pytest.mark.parametrize("micro_batch_size,share_prompt,chunk,completion", [
    (0, True, 1024, 6),       # the automatic micro-batches, each group's prompt run once
    (1, True, 3, 6),          # single rows, log-probs in chunks of 3 tokens
    (1, True, 1024, 2),       # single rows of one completion token after the first: (1, 1) decode-like inputs
    (4, False, 5, 6)])        # every row with its own prompt
def test_qlora_lora_gradients_equal_the_dequantized_model(tiny_folder, tokenizer, micro_batch_size, share_prompt, chunk,
                                                          completion):
    c = load_config(model=tiny_folder, load_in_4bit=True, autocast_bf16=False, lora_r=8, beta=0.04, max_grad_norm=0.0,
                    micro_batch_size=micro_batch_size, share_prompt=share_prompt, logp_chunk_size=chunk,
                    num_generations=G, prompts_per_step=B, max_completion_length=completion, seed=0)
    q_model, _ = load_policy(c)
    torch.manual_seed(1)
    with torch.no_grad():                 # a non-zero adapter B, so that every adapter weight has a gradient
        for n, p in q_model.named_parameters():
            if "lora_B" in n: p.normal_(0, 0.05)
    d_model = dequantized_twin(q_model, c)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True)
               for q in ("What is 2 + 3?", "Name a prime larger than ten.")]
    # eval mode, no grad: the repacking case
    rollout = HFBackend(q_model, tokenizer).generate(prompts, G, completion, seed=0)
    adv = torch.randn(B * G, generator=torch.Generator().manual_seed(2))
    g4, gd = lora_grads(q_model, rollout, adv, c), lora_grads(d_model, rollout, adv, c)
    assert gd.keys() == g4.keys() and len(gd) == 2 * 7 * 2           # A and B of 7 projections in 2 layers
    for n in gd:
        scale = gd[n].abs().max()
        assert scale > 0, n
        assert (g4[n] - gd[n]).abs().max() / scale < 1e-4, (n, ((g4[n] - gd[n]).abs().max() / scale).item())


def test_two_qlora_steps_on_the_cpu(tiny_folder, tmp_path, capsys):
    """The whole loop with a 4-bit base: sampling, evaluation and two updates; a checkpoint at the end (bitsandbytes'
    CPU backend)."""
    from mmrgrpo.trainer import read_metrics, train
    # rewards that vary: the updates are not zero
    c = load_config(model=tiny_folder, load_in_4bit=True, steps=2, num_generations=4, prompts_per_step=2,
                    max_completion_length=8, eval_size=2, save_every=0, log_completions_every=0,
                    output_dir=str(tmp_path), reward_funcs=["reward_fixtures:varied"], reward_weights=None)
    res = train(c, progress=False)
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "reward" in r]
    assert [r["step"] for r in rows] == [1, 2] and all(r["grad_norm"] > 0 for r in rows)
    assert (tmp_path / "checkpoint-2").exists() and "eval/accuracy" in res.eval_after
    compute = str(res.model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.compute_dtype)[6:]
    assert f"; base 4-bit ({compute} compute);" in capsys.readouterr().out      # not the storage dtype, uint8
    assert res.metrics[0]["precision/base"] == f"4-bit ({compute} compute)"


def forward_grads(model, ids) -> dict:
    "The LoRA gradients of sum(sin(logits)) for input ids `ids` (any shape), in train mode."
    model.train(); model.zero_grad(set_to_none=True)
    model(input_ids=ids).logits.float().sin().sum().backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_qlora_gradients_match_for_every_input_shape(tiny_folder):
    """Issue 45 item 21: at input (1, 1) the 4-bit and dequantized gradients of q_proj/k_proj's adapters "differed by
    5.24". With one token, attention has one key: its softmax is 1 whatever q and k, so their exact gradient is 0 and
    both models hold rounding noise (~1e-8 of the largest gradient); noise divided by noise is any number. So the
    tolerance is relative to the largest gradient of the model, and a parameter with an exact zero gradient must be near
    zero in both."""
    c = load_config(model=tiny_folder, load_in_4bit=True, autocast_bf16=False, lora_r=8, num_generations=G,
                    prompts_per_step=B)
    q_model, _ = load_policy(c)
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in q_model.named_parameters():
            if "lora_B" in n: p.normal_(0, 0.05)
    d_model = dequantized_twin(q_model, c)
    q_model.eval()
    # a no-grad single-row forward first: the repacking case
    with torch.no_grad(): q_model(input_ids=torch.tensor([[7]]))
    for shape in [(1, 1), (3, 1), (1, 5), (2, 16)]:
        ids = torch.randint(5, 1000, shape, generator=torch.Generator().manual_seed(0))
        g4, gd = forward_grads(q_model, ids), forward_grads(d_model, ids)
        scale = max(g.abs().max() for g in gd.values())
        assert scale > 0.1, shape
        for n in gd:
            assert (g4[n] - gd[n]).abs().max() / scale < 1e-4, (shape, n, ((g4[n] - gd[n]).abs().max() / scale).item())
            if shape[1] == 1 and ("q_proj" in n or "k_proj" in n):      # one key: zero in exact arithmetic
                assert max(g4[n].abs().max(), gd[n].abs().max()) / scale < 1e-5, (shape, n)
