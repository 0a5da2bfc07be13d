"""How much of a LoRA adapter's effect a bf16 sampling copy keeps, merged from the fp32 base or from a bf16-stored base
(`62b_bf16_update`'s `bf16_frozen_base`), with and without the rounding remainder the bf16 base keeps.

A trained adapter (a checkpoint's `adapter/` folder, e.g. of `mmrgrpo demo`) is loaded into SmolLM2, scaled by 0.1, 0.3
and 1 (0.1x is about the size of the first steps' adapter), and 32 completions of arithmetic prompts are scored by the
fp32 learner (base + unmerged adapter), the base alone, and bf16 copies made by `CopyBackend` three ways. "kept" is
the least-squares slope of (copy - base) on (learner - base) over the completions' log-probs: 1 means the copy moved as
the learner did.

    python bench/merge_lag.py --checkpoint runs/demo/checkpoint-10
"""
import argparse, copy, glob, sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib as bl


def main(argv=None):
    ap = bl.common_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    ap.add_argument("--checkpoint", default="runs/demo/checkpoint-10",
                    help="a checkpoint folder with an adapter/ inside")
    args = ap.parse_args(argv)
    bl.set_threads(args.threads)
    meta = bl.start_meta()
    import torch
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file
    from mmrgrpo.config import load_config
    from mmrgrpo.models import load_policy
    from mmrgrpo.sampling import HFBackend
    from mmrgrpo.sampler_copy import CopyBackend
    from mmrgrpo.bf16_update import bf16_frozen_base, _ROUNDING
    from mmrgrpo.logprobs import completion_stats
    policy, tok = load_policy(load_config(model="tiny-random" if args.quick else "smollm2", dtype="float32", lora=True))
    if not args.quick:
        set_peft_model_state_dict(policy, load_file(glob.glob(f"{args.checkpoint}/adapter/*.safetensors")[0]))
    else:
        with torch.no_grad():
            for n, p in policy.named_parameters():
                if "lora_B" in n: p.normal_(0, 1e-3)
    sums = [(17, 25), (43, 38), (9, 66), (71, 14), (28, 57), (35, 46), (62, 19), (54, 27)]
    prompts = [tok.apply_chat_template([{"role": "user",
                                         "content": f"What is {a} + {b}? Put the final answer in \\boxed{{}}."}],
                                       tokenize=False, add_generation_prompt=True) for a, b in sums]
    ro = HFBackend(policy, tok).generate(prompts, 4, 32, seed=1)
    mask = ro.completion_mask.bool()
    def logp(m):
        with torch.no_grad():
            return completion_stats(m, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)[0][mask]
    B = {n: p.detach().clone() for n, p in policy.named_parameters() if "lora_B" in n}
    rows = []
    for scale in (0.1, 0.3, 1.0):
        with torch.no_grad():
            for n, p in policy.named_parameters():
                if n in B: p.copy_(B[n] * scale)
        learner = logp(policy)
        with policy.disable_adapter(): base = logp(policy)
        effect = learner - base
        base16 = copy.deepcopy(policy); bf16_frozen_base(base16)
        alone = copy.deepcopy(base16)
        # the bf16 weight without its remainder: the merge before the fix
        for m in alone.modules(): _ROUNDING.pop(m, None)
        row = {"adapter_scale": scale, "learner_vs_base_mean_abs": effect.abs().mean().item()}
        for name, m in (("fp32 base", policy), ("bf16 base, remainder kept", base16), ("bf16 weight alone", alone)):
            d = logp(CopyBackend(m, tok, copy_dtype=torch.bfloat16).model) - base
            row[f"kept: {name}"] = ((d * effect).sum() / (effect * effect).sum()).item()
        rows.append(row)
    print(bl.table(rows, list(rows[0]), {k: ".3f" for k in rows[0]}))
    saved = bl.write_json(args.out or bl.result_path('merge_lag', args.quick),
                          {'meta': bl.finish_meta(meta), 'checkpoint': args.checkpoint, 'rows': rows})
    print(f"saved {saved}")


if __name__ == "__main__":
    main()
