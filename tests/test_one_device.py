"""Every tensor that meets the policy's outputs lives on the policy's device (issue 43). CI has no GPU, so the policy
goes to a stand-in device (`tests/elsewhere.py`) where a CPU tensor meeting its outputs fails as it does on CUDA; the
rollout, the rewards and the embeddings come back on the CPU, as vLLM, the reward functions and a CPU embedder hand
them over."""
import pytest, torch
from elsewhere import AWAY, OneDevice, no_autocast_away, send_away
from mmrgrpo.config import load_config
from mmrgrpo.models import add_lora, tiny_random_model
from mmrgrpo.sampling import Rollout
from mmrgrpo.trainer import StepTools, train_step

VOCAB, G, B, T = 200, 4, 2, 6


class _Vocab:
    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0
    def __len__(self): return VOCAB


class _Tokenizer(_Vocab):
    "Just what building a prompt reads."
    def apply_chat_template(self, messages, **kw): return " ".join(m["content"] for m in messages)


class _Sampler:
    "A backend that hands back its rollout on `device`: the CPU as vLLM does, the policy's as transformers does."
    def __init__(self, device, logprobs=False): self.device, self.logprobs = device, logprobs

    def generate(self, prompts, num_generations, max_new_tokens, temperature=1.0, top_p=1.0, seed=0, greedy=False):
        g = torch.Generator().manual_seed(seed)
        N = len(prompts) * num_generations
        p_ids = torch.randint(3, VOCAB, (N, 5), generator=g)
        p_mask = torch.ones(N, 5, dtype=torch.long); p_mask[:, :2] = 0
        c_ids = torch.randint(3, VOCAB, (N, T), generator=g)
        c_mask = torch.ones(N, T, dtype=torch.long); c_mask[1, 3:] = 0
        lp = -torch.rand(N, T, generator=g) * c_mask if self.logprobs else None
        texts = [f"the answer is {i % 3}" for i in range(N)]
        p_ids, p_mask, c_ids, c_mask = (t.to(self.device) for t in (p_ids, p_mask, c_ids, c_mask))
        return Rollout([p for p in prompts for _ in range(num_generations)], texts, p_ids, p_mask, c_ids, c_mask,
                       num_generations, torch.arange(N, device=self.device) // num_generations,
                       None if lp is None else lp.to(self.device))

    def sync_weights(self, model): pass


class _Embedder:
    "A sentence-transformers stand-in whose embeddings come back on `device`."
    def __init__(self, device): self.device = device
    def encode(self, texts, convert_to_tensor=True, **kw):
        return torch.stack([torch.tensor([float(len(t)), float(t[-1].isdigit() and int(t[-1])), 1.0])
                            for t in texts]).to(self.device)


def _reward(completions, **kw): return [float(t.endswith("1")) + 0.1 * len(t) % 1 for t in completions]


COMBINATIONS = {
    "plain": {},
    "mmr": dict(mmr=True),
    "mmr_reference": dict(mmr=True, mmr_variant="reference"),
    "dra": dict(reweight="dra"),
    "prune": dict(prune_rate=0.5),
    "prune_batch_random": dict(prune_rate=0.5, prune_scope="batch", prune_mode="random"),
    "gmts": dict(token_selection="gmts", keep_ratio=0.5),
    "entropy": dict(token_selection="entropy", keep_ratio=0.5),
    "all_three": dict(mmr=True, prune_rate=0.5, token_selection="gmts", keep_ratio=0.5),
    "all_three_iterations_kl": dict(mmr=True, prune_rate=0.5, token_selection="gmts", keep_ratio=0.5, num_iterations=2,
                                    beta=0.04),
    "importance_weights": dict(tis_cap=2.0),
}


# (sampler's device, embedder's device)
WHERE = {"cpu": ("cpu", "cpu"), "policy": (AWAY, AWAY), "mixed": (AWAY, "cpu")}


@pytest.mark.parametrize("name", COMBINATIONS)
@pytest.mark.parametrize("where", WHERE)
def test_a_step_keeps_to_the_policys_device(tmp_path, monkeypatch, name, where):
    "One training step per combination, with rollout and embeddings handed over on the CPU or on the policy's device."
    if where == "mixed" and "mmr" not in name and name != "dra": pytest.skip("no embedder in this combination")
    sampler_device, embedder_device = WHERE[where]
    kw = COMBINATIONS[name]
    c = load_config(model="tiny-random", num_generations=G, prompts_per_step=B, max_completion_length=T, eval_size=0,
                    autocast_bf16=False, sampler_dtype="float32", output_dir=str(tmp_path), lora_r=4, lora_alpha=8,
                    **kw)
    no_autocast_away(monkeypatch)
    with OneDevice():
        model = send_away(add_lora(tiny_random_model(_Vocab()).float(), c))
        assert next(model.parameters()).device == AWAY
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, foreach=False)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        embedder = _Embedder(embedder_device) if c.reweight != "none" else None
        tools = StepTools(model, _Tokenizer(), opt, sched, _Sampler(sampler_device, logprobs=c.tis_cap_ > 0),
                          [_reward, _reward], embedder=embedder)
        records = [{"question": f"q{i}", "answer": "1"} for i in range(B)]
        result = train_step(c, tools, records, seed=0)
    assert result.metrics["loss"] == result.metrics["loss"]          # a number: the step ran to its end
    assert {p.device for p in model.parameters()} == {AWAY}
