"""Prompts: per-task templates, the <think>…</think><answer>…</answer> output format, the exact
answer format each verifier expects, and prompt lengths through the tokenizer's chat template
(rendering itself is jaxrl.hf.tokenizer.chat_prompt_ids).

Every prompt is two chat messages: the shared system prompt (the output format) and the task's
user message (its template filled in, then one line saying what the <answer> span must hold).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from jaxrl.hf.tokenizer import chat_prompt_ids

SYSTEM_PROMPT = (
    "You are a careful reasoner. First think the problem through step by step inside "
    "<think> </think>, then give only the final answer inside <answer> </answer>.")
FORM = ("Reply in exactly this form:\n"
        "<think>your reasoning</think><answer>your final answer</answer>")

_MISSING_FACT = "the one missing fact, as a single short sentence"
_PYTHON = "the source of one Python function `def {entry_point}(...)`"

# task -> user message template; fields are filled by the generator or loader of that task
TEMPLATES: dict[str, str] = {
    "arithmetic": "What is {expression}?",
    "crypto": (
        "Each pair below shows a text and the same text after a secret letter cipher:\n"
        "{examples}\n\nInfer the cipher rule and write one general Python function "
        "`transform(text)` that applies it to any text (letters keep their case; every other "
        "character is unchanged)."),
    "list_fn": (
        "Each pair below shows an input list and the output of one hidden transformation:\n"
        "{examples}\n\nInfer the rule and write one general Python function `transform(lst)` "
        "that returns the output list for any input list."),
    "abduction_rules": (
        "Facts and rules:\n{context}\n\nObservation: {observation}\n\nThe observation cannot be "
        "proved from the facts and rules as given. Give the one missing fact about a single "
        "entity that, added to the facts, makes the observation provable. State it directly "
        "and minimally, in the same wording style as the facts."),
    "uniadilr": (
        "Context sentences:\n{context}\n\nHypothesis: {hypothesis}\n\nWhich context sentences "
        "logically support the hypothesis?"),
    "balanced_copa": (
        "Premise: {premise}\nWhich alternative is the more plausible {question} of the premise?"
        "\n{options}"),
    "causelogics": (
        "Premises:\n{premises}\n\nRules:\n{rules}\n\nPhenomenon: {phenomenon}\nCandidate cause: "
        "{cause}\n\nIs the candidate cause a valid explanation of the phenomenon, given the "
        "premises and rules?"),
    "climate_fever": (
        "Claim: {claim}\n\nEvidence:\n{evidence}\n\nTaken together, does the evidence support "
        "the claim, refute it, dispute it (some evidence supports, some refutes), or give not "
        "enough information?"),
    "abductionrules": (
        "Facts and rules: {context}\n\nObservation: {observation}\n\nGive the one missing fact "
        "that, added to the facts, makes the observation (or its opposite) provable. State it "
        "directly and minimally."),
    "list_functions": (
        "Each pair below shows an input list and the output of one hidden transformation:\n"
        "{examples}\n\nInfer the rule and write one general Python function `transform(lst)` "
        "that returns the output list for any input list."),
    "art": (
        "Observation 1: {observation_1}\nObservation 2: {observation_2}\n\nWhich hypothesis "
        "best explains how observation 1 led to observation 2?\n{options}"),
    "neulr_abductive": (
        "{context}\n\nThe fact above cannot be proved from the facts and rules as given. Give "
        "the one missing fact that, added to the facts, makes it provable."),
    "defeasible_nli": (
        "{premise_line}Hypothesis: {hypothesis}\nUpdate: {update}\n\nDoes the update make the "
        "hypothesis more likely (strengthener) or less likely (weakener)?"),
    "go_emotions": (
        "Text: {text}\n\nWhich emotions does the writer express? Choose one or more of: "
        "{emotions}."),
    "copa_effect": (
        "Premise: {premise}\nWhich alternative is the more plausible effect of the premise?"
        "\n{options}"),
    "musr": "{narrative}\n\n{question}\n{options}",
    "medqa": "{question}\n{options}",
    "ml_debugging": "{question}{options}",
    "strategyqa": "Question: {question}\n\nAnswer yes or no.",
}

# task -> (what its `exact` or `set` answer holds, an example); other kinds say it from their data
_HINTS = {
    "abduction_rules": (_MISSING_FACT, "Bob is kind."),
    "abductionrules": (_MISSING_FACT, "The cat is big."),
    "neulr_abductive": (_MISSING_FACT, "NPabc is ADPxyz."),
    "ml_debugging": ("only the final answer", None),
    "uniadilr": ("only the numbers of the supporting sentences, separated by commas", "1, 3"),
    "go_emotions": ("only the emotion names, separated by commas", "joy, love"),
}


def answer_instruction(task: str, verifier: Mapping) -> str:
    """The line that tells the model exactly what its <answer> span must hold for `verifier`."""
    kind = verifier["kind"]
    if kind == "numeric":
        what, example = "only the final number", "12"
    elif kind == "label":
        what, example = f"exactly one of: {', '.join(verifier['labels'])}", None
    elif kind == "mcq":
        what = f"only the letter of the correct option ({', '.join(verifier['choices'])})"
        example = verifier["choices"][0]
    elif kind == "python":
        what, example = _PYTHON.format(entry_point=verifier["entry_point"]), None
    elif kind in ("exact", "set") and task in _HINTS:
        what, example = _HINTS[task]
    else:
        raise ValueError(f"no answer format for task {task!r} with verifier kind {kind!r}; "
                         f"add one to jaxrl.data.prompts")
    line = f"Inside <answer></answer> write {what}"
    return line + (f", e.g. <answer>{example}</answer>." if example else ".")


# task -> (question, reply): one worked exchange shown in the system prompt. Small models follow
# a shown example far more often than a described format (SmolLM2-135M on arithmetic with the
# <think> prefix: 80% well-formed replies with the example, 44% without).
EXAMPLES: dict[str, tuple[str, str]] = {
    "arithmetic": ("What is 3 + 4?", "<think>3 plus 4 equals 7.</think><answer>7</answer>"),
}


def system_prompt(task: str) -> str:
    """The shared output-format instruction, then the task's worked example where it has one,
    else the reply form spelled out (small models copy a placeholder form literally, so a task
    with an example does not get both)."""
    if task not in EXAMPLES:
        return f"{SYSTEM_PROMPT}\n{FORM}"
    question, reply = EXAMPLES[task]
    return f"{SYSTEM_PROMPT}\nExample:\nUser: {question}\nAssistant: {reply}"


def build_messages(task: str, verifier: Mapping, **fields) -> list[dict]:
    """[system, user] messages for one record of `task`: its template filled with `fields`,
    then the answer format its verifier expects."""
    if task not in TEMPLATES:
        raise ValueError(f"no prompt template for task {task!r}; templates exist for "
                         f"{', '.join(sorted(TEMPLATES))}")
    user = TEMPLATES[task].format(**fields).strip()
    return [{"role": "system", "content": system_prompt(task)},
            {"role": "user", "content": f"{user}\n\n{answer_instruction(task, verifier)}"}]


def lettered(options: Sequence[str]) -> tuple[str, list[str]]:
    """'A. first\\nB. second…' and the letters used, for multiple-choice templates."""
    letters = [chr(ord("A") + i) for i in range(len(options))]
    return "\n".join(f"{k}. {o}" for k, o in zip(letters, options)), letters


def numbered(lines: Sequence[str]) -> str:
    """'1. first\\n2. second…' for templates that list sentences by number."""
    return "\n".join(f"{i}. {line}" for i, line in enumerate(lines, start=1))


def prompt_fits(tokenizer, max_tokens: int) -> Callable[[Mapping], bool]:
    """A `keep` predicate for jaxrl.data.pipeline.build_pool: the record's messages rendered by
    the tokenizer's chat template (assistant turn opened) are at most max_tokens tokens."""
    return lambda record: len(chat_prompt_ids(tokenizer, record["messages"])) <= max_tokens
