"""The datasets jaxrl can load, each mapped to problems with its verifier.

Each Source names the fields its rows need (as its public release spells them), where to get it,
and whether that format is documented publicly. `verified=False` marks sources whose public
format we could not find: their field names are our assumption, stated in `fields` and in the
mapping's docstring, and must be checked against your copy.
CEDAR training sources: uniadilr, balanced_copa, causelogics, climate_fever, abductionrules,
list_functions (Crypto has no documented public format: use the `crypto` generator). CEDAR
evaluation sources: art, neulr_abductive, defeasible_nli, go_emotions, musr, medqa, ml_debugging,
strategyqa, and copa_effect (the Balanced COPA control). Spring evaluation sources (`paper`
"Spring"): ar_lsat, zebralogic (see jaxrl.data.spring_loaders).
"""
from __future__ import annotations

import ast
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from jaxrl.data.prompts import lettered, numbered
from jaxrl.data.records import Problem
from jaxrl.data.spring_loaders import ar_lsat_problems, zebralogic_problems

CLIMATE_LABELS = ("SUPPORTS", "REFUTES", "NOT_ENOUGH_INFO", "DISPUTED")
GO_EMOTIONS = (
    "admiration", "amusement", "anger", "annoyance", "approval", "caring", "confusion",
    "curiosity", "desire", "disappointment", "disapproval", "disgust", "embarrassment",
    "excitement", "fear", "gratitude", "grief", "joy", "love", "nervousness", "optimism", "pride",
    "realization", "relief", "remorse", "sadness", "surprise", "neutral")
YES_NO = {"yes": "yes", "no": "no", "true": "yes", "false": "no", "valid": "yes",
          "invalid": "no", "1": "yes", "0": "no"}


class RowError(ValueError):
    """A row that does not fit its source's format; the loader adds the file and row number."""


@dataclass(frozen=True)
class Source:
    name: str
    title: str
    role: str  # "train" (a training mixture) or "eval" (a held-out suite)
    fields: str  # what a row holds, for error messages
    map_rows: Callable[[list[dict], str], list[Problem]]  # (rows of one file, its origin)
    origin: str  # where the public data lives
    hub: tuple[str, str | None, str] | None = None  # (dataset id, config, split)
    verified: bool = True
    directory: str = ""  # folder under data_dir (default: name)
    json_field: str | None = None  # JSON files keep their rows under this key
    paper: str = "CEDAR"  # the paper whose training mixture or evaluation suite it belongs to


def _get(row: dict, *names: str, optional: bool = False):
    """The first of `names` present in row (several names: documented spellings)."""
    for name in names:
        if name in row and row[name] is not None:
            return row[name]
    if optional:
        return None
    raise RowError(f"missing field {' or '.join(map(repr, names))}; row has "
                   f"{', '.join(sorted(row)) or 'no fields'}")


def _each(rows: list[dict], fn: Callable[[dict], list[Problem]]) -> list[Problem]:
    out = []
    for number, row in enumerate(rows, start=1):
        try:
            out.extend(fn(row))
        except RowError as e:
            raise RowError(f"row {number}: {e}") from None
    return out


def _text_list(value, what: str) -> list[str]:
    if isinstance(value, str):
        return [line.strip() for line in value.splitlines() if line.strip()]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise RowError(f"{what} must be a list of strings or a newline-separated string; "
                   f"got {value!r:.60}")


def _choices(value) -> list[str]:
    """A list of option strings, also from its Python/JSON text form (MuSR's CSV)."""
    if isinstance(value, str):
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise RowError(f"choices {value!r:.60} are not a list literal") from None
    if not (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
        raise RowError(f"choices must be a non-empty list of strings; got {value!r:.60}")
    return value


def _int(value, what: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise RowError(f"{what} {value!r:.40} is not an integer") from None


def _yes_no(value) -> str:
    key = str(value).strip().lower()
    if key not in YES_NO:
        raise RowError(f"label {value!r} is not a yes/no value ({', '.join(YES_NO)})")
    return YES_NO[key]


def _mcq(options: list[str], index: int, fields: dict, metadata: dict | None = None) -> Problem:
    text, letters = lettered(options)
    if not 0 <= index < len(options):
        raise RowError(f"answer index {index} is outside the {len(options)} options")
    return Problem({**fields, "options": text}, letters[index],
                   {"kind": "mcq", "choices": letters}, metadata or {})


def _uniadilr(rows, origin):
    """ASSUMED format (no public schema found): context (list of sentences, or one per line),
    hypothesis, answer (supporting sentence numbers, 1-based: a list or "1, 3")."""
    def one(row):
        context = _text_list(_get(row, "context"), "context")
        answer = _get(row, "answer")
        numbers = answer if isinstance(answer, list) else str(answer).replace(",", " ").split()
        try:
            gold = sorted({int(n) for n in numbers})
        except ValueError:
            raise RowError(f"answer {answer!r:.60} is not a list of sentence numbers") from None
        return [Problem({"context": numbered(context), "hypothesis": _get(row, "hypothesis")},
                        ", ".join(map(str, gold)), {"kind": "set"})]
    return _each(rows, one)


def _copa(question: str):
    def mapping(rows, origin):
        """Balanced COPA card: premise, choice1, choice2, question (cause|effect), label. The
        card's example has label 1 for choice1 (1-based); a file with a label 0 is read as
        SuperGLUE-style 0-based."""
        labels = {_int(r["label"], "label") for r in rows if r.get("label") is not None}
        if {0, 2} <= labels:
            raise RowError(f"labels {sorted(labels)} mix 0-based and 1-based indexing")
        base = 0 if 0 in labels else 1

        def one(row):
            if _get(row, "question") != question:
                return []
            fields = {"premise": _get(row, "premise"), "question": question}
            return [_mcq([_get(row, "choice1"), _get(row, "choice2")],
                         _int(_get(row, "label"), "label") - base, fields,
                         {"mirrored": str(row.get("mirrored")).lower() == "true"})]
        return _each(rows, one)
    return mapping


def _causelogics(rows, origin):
    """ASSUMED format (no public schema found): premises, rules (lists or one per line),
    phenomenon, cause, label (yes/no, true/false, valid/invalid or 1/0), optional level."""
    def one(row):
        fields = {"premises": "\n".join(_text_list(_get(row, "premises"), "premises")),
                  "rules": "\n".join(_text_list(_get(row, "rules"), "rules")),
                  "phenomenon": _get(row, "phenomenon"), "cause": _get(row, "cause")}
        level = row.get("level")
        return [Problem(fields, _yes_no(_get(row, "label")),
                        {"kind": "label", "labels": ["yes", "no"]},
                        {} if level is None else {"group": str(level)})]
    return _each(rows, one)


def _climate_fever(rows, origin):
    """CLIMATE-FEVER card: claim, claim_label (0-3 or its name), evidences [{evidence, ...}]."""
    def one(row):
        label = _get(row, "claim_label")
        if isinstance(label, int):
            if not 0 <= label < len(CLIMATE_LABELS):
                raise RowError(f"claim_label {label} is not 0-{len(CLIMATE_LABELS) - 1}")
            label = CLIMATE_LABELS[label]
        label = str(label).strip().upper().replace(" ", "_")
        if label not in CLIMATE_LABELS:
            raise RowError(f"claim_label {label!r} is not one of {', '.join(CLIMATE_LABELS)}")
        evidence = [e["evidence"] if isinstance(e, dict) else str(e)
                    for e in _get(row, "evidences")]
        return [Problem({"claim": _get(row, "claim"), "evidence": numbered(evidence)}, label,
                        {"kind": "label", "labels": list(CLIMATE_LABELS)})]
    return _each(rows, one)


def _abductionrules(rows, origin):
    """AbductionRules generate.py output: {id, context, questions: [{id, text, label, QCat}]};
    one problem per question, the dataset variant (its folder) as the group."""
    variant = Path(origin).parent.name

    def one(row):
        context = _get(row, "context")
        return [Problem({"context": context, "observation": _get(q, "text")}, _get(q, "label"),
                        {"kind": "exact"}, {"group": variant, "question_id": q.get("id")})
                for q in _get(row, "questions")]
    return _each(rows, one)


def _list_functions(rows, origin):
    """BIG-bench list_functions cNNN/task.json: examples [{input, target}] of one function, as
    JSON list text; the first 5 are shown, the rest are the held-out tests. BIG-bench has no
    reference program, so the gold answer is empty: only the tests grade an answer."""
    shown = 5
    pairs = []
    for number, row in enumerate(rows, start=1):
        try:
            pairs.append((json.loads(_get(row, "input")), json.loads(_get(row, "target"))))
        except (json.JSONDecodeError, TypeError):
            raise RowError(f"row {number}: input/target are not JSON lists") from None
    if len(pairs) <= shown:
        raise RowError(f"needs more than {shown} examples to hold some out; has {len(pairs)}")
    examples = "\n".join(f"{x} -> {y}" for x, y in pairs[:shown])
    tests = [{"input": x, "output": y} for x, y in pairs[shown:]]
    return [Problem({"examples": examples}, "",
                    {"kind": "python", "entry_point": "transform", "tests": tests},
                    {"function": Path(origin).parent.name})]


def _art(rows, origin):
    """ART (allenai/art card): observation_1, observation_2, hypothesis_1, hypothesis_2,
    label (1 or 2)."""
    def one(row):
        label = _int(_get(row, "label"), "label")
        if label not in (1, 2):
            raise RowError(f"label {label} is not 1 or 2")
        fields = {"observation_1": _get(row, "observation_1"),
                  "observation_2": _get(row, "observation_2")}
        return [_mcq([_get(row, "hypothesis_1"), _get(row, "hypothesis_2")], label - 1, fields)]
    return _each(rows, one)


def _neulr(rows, origin):
    """NeuLR abductive_neutral.json: [{id, context (ends 'The fact is: …'), label, explain}]."""
    return _each(rows, lambda row: [Problem({"context": _get(row, "context")},
                                            _get(row, "label"), {"kind": "exact"})])


def _defeasible(rows, origin):
    """Defeasible-NLI README: Premise (absent in delta-social), Hypothesis, Update, UpdateType
    (strengthener|weakener); lower-case premise/hypothesis/update/update_type also read."""
    def one(row):
        premise = _get(row, "Premise", "premise", optional=True)
        update_type = str(_get(row, "UpdateType", "update_type")).strip().lower()
        if update_type not in ("strengthener", "weakener"):
            raise RowError(f"UpdateType {update_type!r} is not strengthener or weakener")
        fields = {"premise_line": f"Premise: {premise}\n" if premise else "",
                  "hypothesis": _get(row, "Hypothesis", "hypothesis"),
                  "update": _get(row, "Update", "update")}
        return [Problem(fields, update_type,
                        {"kind": "label", "labels": ["strengthener", "weakener"]})]
    return _each(rows, one)


def _emotion(value) -> str:
    if isinstance(value, int) and 0 <= value < len(GO_EMOTIONS):
        return GO_EMOTIONS[value]
    if value in GO_EMOTIONS:
        return value
    raise RowError(f"label {value!r:.40} is not a GoEmotions id 0-{len(GO_EMOTIONS) - 1} or name")


def _go_emotions(rows, origin):
    """GoEmotions 'simplified' card: text, labels (ids 0-27 into the 28 names, or the names)."""
    def one(row):
        names = {_emotion(v) for v in _get(row, "labels")}
        gold = ", ".join(sorted(names, key=GO_EMOTIONS.index))
        return [Problem({"text": _get(row, "text"), "emotions": ", ".join(GO_EMOTIONS)}, gold,
                        {"kind": "set"})]
    return _each(rows, one)


def _musr(rows, origin):
    """MuSR (TAUR-Lab/MuSR card): narrative, question, choices (list or its text),
    answer_index; the file name (e.g. murder_mystery) is the group."""
    def one(row):
        fields = {"narrative": _get(row, "narrative"), "question": _get(row, "question")}
        return [_mcq(_choices(_get(row, "choices")), _int(_get(row, "answer_index"),
                                                          "answer_index"), fields,
                     {"group": Path(origin).stem})]
    return _each(rows, one)


def _medqa(rows, origin):
    """MedQA (USMLE jsonl / GBaker card): question, options {letter: text}, answer_idx."""
    def one(row):
        options = {k: v for k, v in _get(row, "options").items() if v is not None}
        letters = sorted(options)
        gold = _get(row, "answer_idx")
        if gold not in options:
            raise RowError(f"answer_idx {gold!r} is not one of the options {letters}")
        return [_mcq([options[k] for k in letters], letters.index(gold),
                     {"question": _get(row, "question")})]
    return _each(rows, one)


def _ml_debugging(rows, origin):
    """ASSUMED format (CEDAR's ML-debugging set has no public schema we could find): question,
    answer, optional choices; with choices the answer is an index (0-based) or a letter."""
    def one(row):
        question, answer = _get(row, "question"), _get(row, "answer")
        choices = row.get("choices")
        if not choices:
            return [Problem({"question": question, "options": ""}, str(answer),
                            {"kind": "exact"})]
        options = _choices(choices)
        index = (ord(answer.strip().upper()[:1] or "?") - ord("A") if isinstance(answer, str)
                 else _int(answer, "answer"))
        return [_mcq(options, index, {"question": question + "\n"})]
    return _each(rows, one)


def _strategyqa(rows, origin):
    """StrategyQA release: qid, question, answer (bool), facts, decomposition."""
    return _each(rows, lambda row: [Problem(
        {"question": _get(row, "question")}, _yes_no(_get(row, "answer")),
        {"kind": "label", "labels": ["yes", "no"]})])


SOURCES = {s.name: s for s in (
    Source("uniadilr", "UniADILR (supporting-sentence selection)", "train",
           "context, hypothesis, answer", _uniadilr, "the UniADILR release", verified=False),
    Source("balanced_copa", "Balanced COPA, cause questions", "train",
           "premise, choice1, choice2, question, label", _copa("cause"),
           "https://huggingface.co/datasets/pkavumba/balanced-copa",
           ("pkavumba/balanced-copa", None, "train")),
    Source("causelogics", "CauseLogics (candidate-cause validity)", "train",
           "premises, rules, phenomenon, cause, label", _causelogics, "the CauseLogics release",
           verified=False),
    Source("climate_fever", "CLIMATE-FEVER claim verification", "train",
           "claim, claim_label, evidences", _climate_fever,
           "https://huggingface.co/datasets/tdiggelm/climate_fever",
           ("tdiggelm/climate_fever", None, "test")),
    Source("abductionrules", "AbductionRules (Animal/Person, Simple or not)", "train",
           "context, questions [{text, label}]", _abductionrules,
           "https://github.com/Strong-AI-Lab/AbductionRules (datasets/<variant>/*.jsonl)"),
    Source("list_functions", "BIG-bench list_functions", "train", "examples [{input, target}]",
           _list_functions, "https://github.com/google/BIG-bench "
           "(bigbench/benchmark_tasks/list_functions/cNNN/task.json)", json_field="examples"),
    Source("art", "ART (alpha-NLI) hypothesis selection", "eval",
           "observation_1, observation_2, hypothesis_1, hypothesis_2, label", _art,
           "https://huggingface.co/datasets/allenai/art", ("allenai/art", "anli", "validation")),
    Source("neulr_abductive", "NeuLR abductive split", "eval", "context, label", _neulr,
           "https://github.com/DeepReasoning/NeuLR (abductive_neutral.json)"),
    Source("defeasible_nli", "Defeasible NLI", "eval", "Premise, Hypothesis, Update, UpdateType",
           _defeasible, "https://github.com/rudinger/defeasible-nli (one portion's jsonl)"),
    Source("go_emotions", "GoEmotions (simplified)", "eval", "text, labels", _go_emotions,
           "https://huggingface.co/datasets/google-research-datasets/go_emotions",
           ("google-research-datasets/go_emotions", "simplified", "test")),
    Source("musr", "MuSR (murder mysteries, object placements, team allocation)", "eval",
           "narrative, question, choices, answer_index", _musr,
           "https://huggingface.co/datasets/TAUR-Lab/MuSR",
           ("TAUR-Lab/MuSR", None, "murder_mysteries")),
    Source("medqa", "MedQA (USMLE)", "eval", "question, options, answer_idx", _medqa,
           "https://huggingface.co/datasets/GBaker/MedQA-USMLE-4-options",
           ("GBaker/MedQA-USMLE-4-options", None, "test")),
    Source("ml_debugging", "ML debugging", "eval", "question, answer, choices (optional)",
           _ml_debugging, "the CEDAR ML-debugging set", verified=False),
    Source("strategyqa", "StrategyQA", "eval", "question, answer", _strategyqa,
           "https://github.com/eladsegal/strategyqa (strategyqa_train.json)"),
    Source("copa_effect", "Balanced COPA, effect questions (control)", "eval",
           "premise, choice1, choice2, question, label", _copa("effect"),
           "https://huggingface.co/datasets/pkavumba/balanced-copa",
           ("pkavumba/balanced-copa", None, "test"), directory="balanced_copa"),
    Source("ar_lsat", "AR-LSAT analytical reasoning", "eval",
           "passage, questions [{question, options, answer}]", ar_lsat_problems,
           "https://github.com/zhongwanjun/AR-LSAT (data/AR_*Data.json)", paper="Spring"),
    Source("zebralogic", "ZebraLogicBench grid mode, with solutions", "eval",
           "id, size, puzzle, solution {header, rows}", zebralogic_problems,
           "https://huggingface.co/datasets/allenai/ZebraLogicBench-private (grid_mode)",
           ("allenai/ZebraLogicBench-private", "grid_mode", "test"), paper="Spring"),
)}
