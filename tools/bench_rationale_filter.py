"""Rationale filtration throughput: records per second, jaxrl against transformers doing the
same computation, each in processes of its own with its own defaults, alternating round by round
(tools/peers.py).

Each record is scored twice (with and without its rationale): S = sum_i 0.9^i log p(token i
of `following` | preceding [+ rationale]) over the first 128 following tokens. jaxrl:
`jaxrl.rationale.filter.filter_records` (batched and bucketed by length, jitted; a first call
compiles and is timed apart). transformers: the same token ids, sorted by length and
right-padded in batches of --torch-batch, one forward pass per batch with the LM head applied
only at the scored positions, after a warm-up on 4 records; torch keeps its thread settings.
Both fp32 on the CPU. The two implementations' scores are compared as a check.

    python tools/bench_rationale_filter.py [--model default] [--records 64] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
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


def transformers_worker(model_dir: str, records: int, batch: int, result_file: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    recs = make_records(records)
    torch_scores(model, tokenizer, recs[:4], batch)  # warm-up
    start = time.perf_counter()
    scores = torch_scores(model, tokenizer, recs, batch)
    _write(result_file, {"seconds": time.perf_counter() - start, "scores": scores.tolist(),
                         "torch_threads": torch.get_num_threads()})


def jaxrl_worker(model_path: str, records: int, tokens_per_batch: int, result_file: str) -> None:
    from jaxrl.hf.pretrained import load_pretrained
    from jaxrl.rationale.filter import FilterSettings, filter_records
    from jaxrl.rationale.scoring import ScoreOptions

    recs = make_records(records)
    model = load_pretrained(model_path)
    settings = FilterSettings(score=ScoreOptions(tokens_per_batch=tokens_per_batch))
    start = time.perf_counter()
    filter_records(model, recs, settings)
    first = time.perf_counter() - start
    start = time.perf_counter()
    ours = filter_records(model, recs, settings)
    seconds = time.perf_counter() - start
    scores = np.array([[r["score_with"], r["score_without"]] for r in ours]).reshape(-1)
    tokens = sum(len(model.ids(r["following"])[:128]) for r in recs)
    _write(result_file, {"seconds": seconds, "first_s": first, "scores": scores.tolist(),
                         "tokens": tokens})


def _write(path: str, figures: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(figures) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--records", type=int, default=64)
    parser.add_argument("--torch-batch", type=int, default=16)
    parser.add_argument("--tokens-per-batch", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of alternation (2)")
    args = parser.parse_args()
    from jaxrl.hf.default_model import resolve_model_path
    from peers import alternate, load_range

    model_dir = str(resolve_model_path(args.model))
    n = str(args.records)
    rounds = alternate({
        "jaxrl": lambda out: [sys.executable, __file__, "jaxrl", model_dir, n,
                              str(args.tokens_per_batch), out],
        "transformers": lambda out: [sys.executable, __file__, "transformers", model_dir, n,
                                     str(args.torch_batch), out]}, args.rounds)
    print("| round | jaxrl first call, compiling (s) | jaxrl (s) | transformers "
          f"{args.torch_batch}-row batches (s) | jaxrl / transformers time | max score "
          "difference | load |", "| ---: " * 7 + "|", sep="\n")
    for i, r in enumerate(rounds, 1):
        ours, theirs = r["jaxrl"]["rows"][0], r["transformers"]["rows"][0]
        diff = np.abs(np.array(ours["scores"]) - np.array(theirs["scores"])).max()
        print(f"| {i} | {ours['first_s']:.1f} | {ours['seconds']:.1f} | {theirs['seconds']:.1f} "
              f"| {ours['seconds'] / theirs['seconds']:.2f} | {diff:.1e} | {load_range([r])} |")
    print(f"{args.records} records ({2 * args.records} scored sequences, "
          f"{rounds[0]['jaxrl']['rows'][0]['tokens']} following tokens), {model_dir}")


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "transformers":
        transformers_worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    elif len(sys.argv) == 6 and sys.argv[1] == "jaxrl":
        jaxrl_worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    else:
        main()
