"""Rationale filtration throughput: records per second, jaxrl against transformers doing the
same computation in the same run.

Each record is scored twice (with and without its rationale): S = sum_i 0.9^i log p(token i
of `following` | preceding [+ rationale]) over the first 128 following tokens. jaxrl:
`jaxrl.rationale.filter.filter_records` (batched and bucketed by length, jitted; one warm-up
call compiles). transformers: the same token ids, sorted by length and right-padded in batches
of --torch-batch, one forward pass per batch with the LM head applied only at the scored
positions. Both fp32 on the CPU. The two implementations' scores are compared as a check.

    python tools/bench_rationale_filter.py [--model default] [--records 64]
"""
from __future__ import annotations

import argparse
import os
import random
import time

import numpy as np

SENTENCES = (
    "The committee met on Tuesday to review the budget.", "Costs had risen sharply since spring.",
    "Several members asked for a detailed breakdown.", "The treasurer promised a report by "
    "Friday.", "Meanwhile the library extended its opening hours.", "Students had complained "
    "about the lack of quiet space.", "A new reading room opened on the second floor.",
    "Attendance rose by a third within a month.", "The river flooded the lower fields again.",
    "Farmers moved their animals to higher ground.", "Repairs to the levee began in May.")


def make_records(n: int, seed: int = 0) -> list[dict]:
    """Documents of 3 to 14 sentences split at a random sentence, with a rationale."""
    rng = random.Random(seed)
    records = []
    for _ in range(n):
        doc = [rng.choice(SENTENCES) for _ in range(rng.randint(3, 14))]
        cut = rng.randint(1, len(doc) - 1)
        records.append({"preceding": " ".join(doc[:cut]),
                        "rationale": "What follows is a consequence of what was just said.",
                        "following": " " + " ".join(doc[cut:] + [rng.choice(SENTENCES)] * 6)})
    return records


def torch_scores(model, tok, records, batch: int, decay: float = 0.9, cap: int = 128):
    """[2N] scores (with, without, ...) by transformers, the LM head only where scored."""
    import torch

    rows = []
    for r in records:
        pre = tok(r["preceding"])["input_ids"]
        mid = tok(" " + r["rationale"], add_special_tokens=False)["input_ids"]
        fol = tok(r["following"], add_special_tokens=False)["input_ids"][:cap]
        rows += [(pre + mid, fol), (pre, fol)]
    order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]) + len(rows[i][1]))
    out = np.zeros(len(rows))
    with torch.inference_mode():
        for s in range(0, len(order), batch):
            members = order[s:s + batch]
            width = max(len(rows[i][0]) + len(rows[i][1]) for i in members)
            ids = torch.zeros((len(members), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            where, targets, weights, owner = [], [], [], []
            for b, i in enumerate(members):
                ctx, fol = rows[i]
                ids[b, :len(ctx) + len(fol)] = torch.tensor(ctx + fol)
                mask[b, :len(ctx) + len(fol)] = 1
                for j, t in enumerate(fol):
                    where.append((b, len(ctx) + j - 1))
                    targets.append(t)
                    weights.append(decay ** j)
                    owner.append(b)
            h = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
            at = torch.tensor(where)
            logp = torch.log_softmax(model.lm_head(h[at[:, 0], at[:, 1]]).float(), -1)
            picked = logp[torch.arange(len(targets)), torch.tensor(targets)]
            weighted = picked.double() * torch.tensor(weights, dtype=torch.float64)
            sums = torch.zeros(len(members), dtype=torch.float64).index_add_(
                0, torch.tensor(owner), weighted)
            out[members] = sums.numpy()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--records", type=int, default=64)
    parser.add_argument("--torch-batch", type=int, default=16)
    parser.add_argument("--tokens-per-batch", type=int, default=8192)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from jaxrl.hf.pretrained import load_pretrained
    from jaxrl.rationale.filter import FilterSettings, filter_records
    from jaxrl.rationale.scoring import ScoreOptions

    torch.set_num_threads(os.cpu_count() or 1)
    records = make_records(args.records)
    model = load_pretrained(args.model)
    settings = FilterSettings(score=ScoreOptions(tokens_per_batch=args.tokens_per_batch))
    start = time.perf_counter()
    filter_records(model, records, settings)
    first = time.perf_counter() - start
    start = time.perf_counter()
    ours = filter_records(model, records, settings)
    jax_s = time.perf_counter() - start
    hf = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32).eval()
    torch_scores(hf, model.tokenizer, records[:4], args.torch_batch)  # warm-up
    start = time.perf_counter()
    theirs = torch_scores(hf, model.tokenizer, records, args.torch_batch)
    torch_s = time.perf_counter() - start
    mine = np.array([[r["score_with"], r["score_without"]] for r in ours]).reshape(-1)
    tokens = sum(len(model.ids(r["following"])[:128]) for r in records)
    print(f"{args.records} records ({2 * args.records} scored sequences, {tokens} following "
          f"tokens), model {model.path.name}, load average {os.getloadavg()[0]:.1f}, "
          f"max |score difference| {np.abs(mine - theirs).max():.2e}")
    print("| implementation | seconds | records/s |")
    print("| --- | --- | --- |")
    print(f"| jaxrl `filter_records` (first call, compiling) | {first:.2f} | "
          f"{args.records / first:.1f} |")
    print(f"| jaxrl `filter_records` | {jax_s:.2f} | {args.records / jax_s:.1f} |")
    print(f"| transformers {args.torch_batch}-row batches | {torch_s:.2f} | "
          f"{args.records / torch_s:.1f} |")


if __name__ == "__main__":
    main()
