"""Attention in the fused bf16 decoder's decode step: torch's SDPA (what the package runs) vs two hand-written ways.

Torch's `scaled_dot_product_attention` and the two ways of writing it by hand each run a whole generation of the bench
config, interleaved. The two hand-written ways lost, so they live here and not in the package; this script is the
record of why.

Attention was the largest piece of a generation that no fusion touched (section 0a of BENCHMARKS_HISTORY.md: 0.25-0.6 ms
a call, 29% of a generation under the profiler), because torch's CPU kernel works one row and head at a time with one
query each. Arms:
- `sdpa`: `FusedDecoder` as it is (`61a_fused_decode`): SDPA over each row's cached keys `[:n]`, grouped key-value
  heads;
- `matmul`: two batched matmuls and a softmax per layer over the cache's whole room (so that each row's keys are one
  contiguous block: bf16 batched matmuls over the strided `[:n]` slices took 5x longer in a microbenchmark), positions
  not yet written masked with -inf in the row's bias, the cache zeroed once so they hold finite numbers; the scores in
  bf16;
- `grouped`: each prompt's keys and values kept once (not once per completion), the queries of all rows scored against
  all prompts' keys in one matmul per key-value head (another prompt's keys masked with -inf), the completion's own keys
  in a second, one softmax over both: the prompt-once-per-group attention section 0a proposed, in the form that
  survives rows leaving the batch in any order.
Every arm prefills each prompt whole (`share_prefix=False`: the shared prefix came after this comparison, and the
hand-written caches assume whole prompts), and keeps its KV cache and attention in bf16 (`attn_dtype`), as on the Intel
with AMX where this ran (the package attends in fp32 on a CPU without AMX). The bf16 arms sample slightly different
tokens (their scores round differently): valid tokens are recorded beside the seconds, and the time per valid token is
the fair comparison. A torch profile of one more generation per arm gives the time inside attention's own ops.

    python bench/decode_attention.py                # about 1 min on an idle 2-core machine
    python bench/decode_attention.py --quick        # tiny random model, seconds
"""
import argparse, sys, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl
from generation import bench_inputs

ATTENTION_OPS = ("aten::_scaled_dot_product", "aten::bmm", "aten::_softmax", "aten::cat", "aten::add_")


def decoders():
    "(matmul, grouped): the two hand-written decoders, subclasses of the package's `FusedDecoder`."
    import torch
    import torch.nn.functional as F
    from mmrgrpo.fused_decode import FusedDecoder, linear, rms_norm, rotate

    class Matmul(FusedDecoder):
        "SDPA for the prefill; one query per row by two matmuls over the cache's whole room."
        def new_cache(self, rows, room):
            cache = super().new_cache(rows, room)
            cache.k.zero_(); cache.v.zero_()                     # unwritten positions finite: masked, not NaN
            return cache

        # whole prompts: the caches below assume them
        def prefill(self, ids, mask, group_size, room, share_prefix=False):
            cache = super().prefill(ids, mask, group_size, room, share_prefix=False)
            cache.bias[..., cache.n:] = float("-inf")            # positions not yet written
            return cache

        def decode(self, ids, pos, cache):
            cache.bias[..., cache.n] = 0
            return self.layers_forward(ids, pos, cache, lambda j, q: self.attend(q, cache.k[j], cache.v[j], cache.bias))

        def attend(self, q, k, v, bias):
            B, H, D = q.shape
            s = (q.reshape(B, k.shape[1], H // k.shape[1], D) * D ** -0.5) @ k.transpose(-1, -2)
            return (torch.softmax(s.add_(bias), -1) @ v).view(B, 1, H * D)

        @torch.no_grad()
        def layers_forward(self, ids, pos, cache, attend, write=None):
            B, H, Hkv, D, n = ids.shape[0], self.heads, self.kv_heads, self.head_dim, cache.n
            x = self.model.model.embed_tokens(ids)
            cos, sin = self.model.model.rotary_emb(x, pos)
            for j, l in enumerate(self.layers):
                qkv = linear(rms_norm(x, l["norm1"], self.eps), l["qkv"], l["qkv_bias"]).view(B, H + 2 * Hkv, D)
                qk = rotate(qkv[:, :H + Hkv], cos[:, 0, None], sin[:, 0, None])
                if write is None: cache.k[j, :, :, n], cache.v[j, :, :, n] = qk[:, H:], qkv[:, H + Hkv:]
                else: write(j, qk[:, H:], qkv[:, H + Hkv:])
                x = x + linear(attend(j, qk[:, :H]), l["o"], l["o_bias"])
                gate, up = linear(rms_norm(x, l["norm2"], self.eps), l["gate_up"]).chunk(2, -1)
                x = x + linear(F.silu(gate) * up, l["down"])
            cache.n = n + 1
            return linear(rms_norm(x[:, -1], self.norm, self.eps), self.head)

    class GroupCache:
        """Prompt keys/values once per prompt (layers, Hkv, U*P, D); each row's own (layers, Hkv, rows, room, D); bias
        (rows, U*P + room)."""
        def __init__(self, cache, U, P, g, room):
            L, _, Hkv, _, D = cache.k.shape
            once = lambda t: t[:, :, :, :P].permute(0, 2, 1, 3, 4).reshape(L, Hkv, U * P, D).contiguous()
            self.kp, self.vp, B = once(cache.k), once(cache.v), U * g
            self.kc = torch.zeros(L, Hkv, B, room, D, dtype=cache.k.dtype); self.vc = torch.zeros_like(self.kc)
            own = torch.full((B, U, P), float("-inf"), dtype=cache.k.dtype)
            group = torch.arange(B) // g
            own[torch.arange(B), group] = cache.bias[group, 0, 0, :P]
            self.bias = torch.cat([own.view(B, U * P), torch.full((B, room), float("-inf"), dtype=cache.k.dtype)], 1)
            self.UP, self.n = U * P, 0

        def batch_select_indices(self, indices):
            m, n = len(indices), self.n
            moved = (indices != torch.arange(m)).nonzero().squeeze(-1)
            if len(moved):
                self.kc[:, :, moved, :n], self.vc[:, :, moved, :n] = (self.kc[:, :, indices[moved], :n],
                                                                      self.vc[:, :, indices[moved], :n])
                self.bias[moved] = self.bias[indices[moved]]
            self.kc, self.vc, self.bias = self.kc[:, :, :m], self.vc[:, :, :m], self.bias[:m]

    class Grouped(Matmul):
        "Each prompt's keys once; all rows against all prompts in one matmul per key-value head, then their own keys."
        def prefill(self, ids, mask, group_size, room, share_prefix=False):
            return GroupCache(FusedDecoder.prefill(self, ids, mask, 1, room, share_prefix=False), *ids.shape,
                              group_size, room)

        def decode(self, ids, pos, cache):
            cache.bias[:, cache.UP + cache.n] = 0
            def write(j, k, v):
                cache.kc[j, :, :, cache.n], cache.vc[j, :, :, cache.n] = k.transpose(0, 1), v.transpose(0, 1)
            return self.layers_forward(ids, pos, cache, lambda j, q: self.attend(q, cache, j), write)

        def attend(self, q, cache, j):
            B, H, D = q.shape
            Hkv, UP = cache.kp.shape[1], cache.UP
            q = (q * D ** -0.5).view(B, Hkv, H // Hkv, D).transpose(0, 1)                 # (Hkv, B, r, D)
            prompt = (q.reshape(Hkv, -1, D) @ cache.kp[j].transpose(-1, -2)).view(Hkv, B, -1, UP)
            p = torch.softmax(torch.cat([prompt, q @ cache.kc[j].transpose(-1, -2)], -1)
                              .add_(cache.bias[None, :, None]), -1)
            o = (p[..., :UP].reshape(Hkv, -1, UP) @ cache.vp[j]).view(Hkv, B, -1, D) + p[..., UP:] @ cache.vc[j]
            return o.permute(1, 0, 2, 3).reshape(B, 1, H * D)

    return Matmul, Grouped


def main(argv=None):
    ap = bl.common_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    ap.add_argument("--repeats", type=int, default=None, help="timed rounds per arm (default 3; --quick 2)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
    args = ap.parse_args(argv)
    bl.set_threads(args.threads)
    meta = bl.start_meta()
    import torch
    from torch.profiler import profile, ProfilerActivity
    from mmrgrpo.fused_decode import FusedBackend
    c, model, tok, prompts, seed = bench_inputs(args)
    backend = FusedBackend(model, tok, c.max_prompt_length, c.share_prompt, copy_dtype=torch.bfloat16,
                           share_prefix=False, attn_dtype=torch.bfloat16)
    Matmul, Grouped = decoders()
    arms = {"sdpa": backend.decoder, "matmul": Matmul(backend.model, torch.bfloat16),
            "grouped": Grouped(backend.model, torch.bfloat16)}
    repeats, raw = args.repeats or (2 if args.quick else 3), {a: [] for a in arms}
    def generate(arm):
        backend.decoder = arms[arm]
        t0 = time.perf_counter()
        ro = backend.generate(prompts, c.num_generations, c.max_completion_length, c.temperature, c.top_p, seed=seed)
        return time.perf_counter() - t0, int(ro.completion_mask.sum())
    for rep, arm in bl.interleaved(list(arms), repeats + 1):
        s, valid = generate(arm)
        print(f"  {'warm-up' if rep == 0 else f'round {rep}'}  {arm:8s} {s:6.2f} s  {valid} valid tokens", flush=True)
        if rep: raw[arm].append({"seconds": s, "valid_tokens": valid})
    rows = []
    for arm in arms:
        with profile(activities=[ProfilerActivity.CPU]) as prof: generate(arm)
        ops = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key.startswith(ATTENTION_OPS)) / 1e6
        s, valid = bl.median([r["seconds"] for r in raw[arm]]), bl.median([r["valid_tokens"] for r in raw[arm]])
        rows.append({"arm": arm, "seconds": s, "valid_tokens": valid, "ms_per_valid_token": 1e3 * s / valid,
                     "attention_ops_s (profiled)": ops})
    base = rows[0]["ms_per_valid_token"]
    for r in rows: r["per token vs sdpa"] = r["ms_per_valid_token"] / base
    print(bl.table(rows, list(rows[0]), {"seconds": ".2f", "ms_per_valid_token": ".3f",
                                         "attention_ops_s (profiled)": ".2f", "per token vs sdpa": ".2f"}))
    out = bl.write_json(args.out or bl.result_path("decode_attention", args.quick),
                        {"meta": bl.finish_meta(meta), "config": {k: getattr(c, k) for k in ("model", "num_generations",
                         "prompts_per_step", "max_completion_length")}, "rows": rows, "raw": raw})
    print(f"saved {out}")


if __name__ == "__main__":
    main()
