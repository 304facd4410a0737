"""`jaxrl guide --model PATH (--question TEXT | --input FILE.jsonl) [...]`: rationale-guided
decoding (RATIONALYST)."""
from __future__ import annotations

import json
import sys

from jaxrl.commands import read_input_objects
from jaxrl.config import DTYPES, QUANT_MODES, UsageError

ROLES = ("agent", "rationale", "scorer")


def register(sub) -> None:
    p = sub.add_parser(
        "guide", help="rationale-guided step-by-step decoding (RATIONALYST)",
        description="Each step the rationale model writes a rationale for the trajectory, the "
        "agent proposes --k next sentences (temperature --temperature), and the scorer keeps "
        "the one with the highest mean log p(step | trajectory, rationale) (implicit "
        "supervision; --contrastive subtracts log p(step | trajectory)); --mode explicit puts "
        "the rationale into the agent's context instead. Stops at --answer-pattern, at the "
        "agent's end of reply or after --max-steps. Local roles share the base of --model, "
        "each with its own adapter; the agent and the rationale writer may be remote "
        "(OpenAI-compatible --agent-url / --rationale-url).")
    p.add_argument("--model", required=True, metavar="PATH", help="base of the local roles")
    for role in ROLES:
        p.add_argument(f"--{role}-adapter", default=None, metavar="DIR",
                       help=f"PEFT adapter of the {role} (default: the base alone)")
    for role in ROLES[:2]:
        p.add_argument(f"--{role}-url", default=None, metavar="URL",
                       help=f"OpenAI-compatible API of a remote {role}")
        p.add_argument(f"--{role}-model", default="", metavar="NAME",
                       help=f"model name of the remote {role}")
    p.add_argument("--api-key-env", default="OPENAI_API_KEY",
                   help="environment variable holding the remote API key")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--question", metavar="TEXT")
    source.add_argument("--input", metavar="FILE.jsonl",
                        help="records with `question` or chat `messages` (the last user turn)")
    p.add_argument("--out", default=None, metavar="FILE.jsonl", help="default: stdout")
    p.add_argument("--k", type=int, default=3, help="candidates per step (default 3)")
    p.add_argument("--temperature", type=float, default=0.7, help="agent (default 0.7)")
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--max-step-tokens", type=int, default=64)
    p.add_argument("--max-rationale-tokens", type=int, default=64)
    p.add_argument("--mode", choices=("implicit", "explicit"), default="implicit")
    p.add_argument("--contrastive", action="store_true")
    p.add_argument("--answer-pattern", default=None, metavar="REGEX",
                   help="its first group is the answer (default: 'The answer is: N')")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--quant", choices=QUANT_MODES, default="none")
    p.set_defaults(func=_guide)


def _questions(args) -> list[dict]:
    if args.question is not None:
        return [{"question": args.question}]
    records = read_input_objects(args.input)
    for number, record in enumerate(records, 1):
        users = [m.get("content") for m in record.get("messages") or []
                 if isinstance(m, dict) and m.get("role") == "user"]
        question = record.get("question") or (users[-1] if users else None)
        if not isinstance(question, str) or not question.strip():
            raise UsageError(f"--input {args.input!r} record {number} has no `question` and no "
                             "user message")
        record["question"] = question
    return records


def _settings(args):
    import re

    from jaxrl.rationale.guide import DEFAULT_ANSWER_PATTERN, GuideSettings

    try:
        return GuideSettings(k=args.k, max_steps=args.max_steps, mode=args.mode,
                             contrastive=args.contrastive,
                             answer_pattern=args.answer_pattern or DEFAULT_ANSWER_PATTERN)
    except (ValueError, re.error) as error:  # a bad count or regular expression
        raise UsageError(f"--k, --max-steps or --answer-pattern: {error}") from None


def _roles(args):
    import jax

    from jaxrl.config import JudgeConfig
    from jaxrl.hf.peft_io import load_peft_adapter
    from jaxrl.hf.pretrained import load_pretrained
    from jaxrl.rationale import roles

    model = load_pretrained(args.model, dtype=args.dtype, quant=args.quant)  # the base, once
    lora = {r: None if getattr(args, f"{r}_adapter") is None else
            load_peft_adapter(getattr(args, f"{r}_adapter"), model.spec) for r in ROLES}

    def remote(role: str, temperature: float) -> JudgeConfig:
        return JudgeConfig(base_url=getattr(args, f"{role}_url"),
                           model=getattr(args, f"{role}_model"), api_key_env=args.api_key_env,
                           temperature=temperature, max_tokens=256, cache=False)

    propose = roles.remote_proposer(remote("agent", args.temperature), args.k) \
        if args.agent_url else roles.local_proposer(
            model, lora["agent"], jax.random.PRNGKey(args.seed), temperature=args.temperature,
            max_new_tokens=args.max_step_tokens)
    write = roles.remote_rationale_writer(remote("rationale", 0.0)) if args.rationale_url \
        else roles.local_rationale_writer(model, lora["rationale"],
                                          max_new_tokens=args.max_rationale_tokens)
    return propose, write, roles.local_scorer(model, lora["scorer"])


def _guide(args) -> int:
    import dataclasses

    from jaxrl.commands.rationale import write_objects
    from jaxrl.rationale.guide import guide

    settings = _settings(args)
    records = _questions(args)
    propose, write, score = _roles(args)
    results = []
    for record in records:
        result = guide(record["question"], propose, write, score, settings)
        results.append({**record, **dataclasses.asdict(result)})
        print(f"jaxrl guide: {len(result.steps)} steps, finish {result.finish}, answer "
              f"{result.answer}", file=sys.stderr)
    if args.out:
        write_objects(args.out, results)
    else:
        for row in results:
            print(json.dumps(row, ensure_ascii=False))
    return 0
