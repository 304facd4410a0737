"""The texts RATIONALYST's stages share: the extraction instructions and demonstrations, the
layout of a reasoning context, how a rationale is inserted before the text it explains, and
the chat messages of the rationale model (the same for its SFT records and for decoding).

An implicit rationale names the reasoning that links what was said to what comes next (a
principle, a goal, the next operation and why), never the next text's content or result.
"""
from __future__ import annotations

BOT, EOT = "<BOT>", "<EOT>"
# The rationale goes inline, as a sentence of the text, before the text it should predict.
DEFAULT_TEMPLATE = " {rationale}"

_RULES = f"""Copy the text you are given exactly, word for word, and insert implicit rationales \
into it. An implicit rationale is the unstated reasoning a reader needs to anticipate the next \
sentence: the principle, goal or plan that connects what has been said to what follows.

Rules:
- Do not change, add or remove any word of the text itself.
- After a sentence whose continuation relies on unstated reasoning, insert one rationale as \
{BOT}rationale{EOT}. Not every sentence needs one; add none after the last sentence.
- A rationale is one short sentence about why or what to do next. It must not state the \
content of the next sentence, the result of a calculation, a conclusion, or the final answer.
- Reply with the annotated text only."""

_DOCUMENT_DEMO = (
    "The bridge was closed for repairs on Monday. Commuters from the east bank left home "
    "half an hour earlier than usual. By Wednesday the ferry company had added two extra "
    "crossings each morning.",
    f"The bridge was closed for repairs on Monday. {BOT}Without the bridge, people who cross "
    f"the river to work need a slower route.{EOT} Commuters from the east bank left home half "
    f"an hour earlier than usual. {BOT}When demand for the remaining route rises, its operator "
    f"has a reason to offer more service.{EOT} By Wednesday the ferry company had added two "
    "extra crossings each morning.")

_SOLUTION_DEMO = (
    "A baker makes 12 loaves in the morning and twice as many in the afternoon. She sells all "
    "but 5 of them. How many loaves does she sell?",
    "In the afternoon she makes 2 * 12 = 24 loaves. In total she makes 12 + 24 = 36 loaves. "
    "She sells 36 - 5 = 31 loaves.",
    f"In the afternoon she makes 2 * 12 = 24 loaves. {BOT}Both batches count towards the "
    f"day's loaves, so the two amounts should be added.{EOT} In total she makes 12 + 24 = 36 "
    f"loaves. {BOT}The loaves she keeps are not sold, so they come off the total.{EOT} She "
    "sells 36 - 5 = 31 loaves.")

RATIONALE_SYSTEM = ("Write the implicit rationale for the text below: one short sentence of "
                    "reasoning that connects what it has said to what should come next. Do "
                    "not write the next step itself, its result or a final answer.")


def extraction_messages(text: str, question: str | None = None) -> list[dict]:
    """Chat messages asking a generator to copy `text` with rationales inserted; with a
    `question`, `text` is its worked solution and only the solution is annotated."""
    if question is None:
        demo_in, demo_out = _DOCUMENT_DEMO
        return [{"role": "system", "content": _RULES},
                {"role": "user", "content": f"Text:\n{demo_in}"},
                {"role": "assistant", "content": demo_out},
                {"role": "user", "content": f"Text:\n{text}"}]
    demo_q, demo_in, demo_out = _SOLUTION_DEMO
    ask = "Annotate the solution only (copy it with rationales inserted)."
    return [{"role": "system", "content": _RULES},
            {"role": "user", "content": f"Question:\n{demo_q}\n\nSolution:\n{demo_in}\n\n{ask}"},
            {"role": "assistant", "content": demo_out},
            {"role": "user", "content": f"Question:\n{question}\n\nSolution:\n{text}\n\n{ask}"}]


def reasoning_context(question: str, steps: str) -> str:
    """A question and the reasoning written so far, as one text (extraction records of
    reasoning datasets and guided decoding lay it out the same way)."""
    return f"{question.strip()}\n\n{steps}"


def rationale_messages(context: str) -> list[dict]:
    """The rationale model's prompt for a context; its reply is the rationale."""
    return [{"role": "system", "content": RATIONALE_SYSTEM},
            {"role": "user", "content": context}]


def insert_rationale(rationale: str, template: str = DEFAULT_TEMPLATE) -> str:
    """The text placed between a context and its continuation to condition on a rationale."""
    return template.format(rationale=rationale.strip())


def rationale_chat(preceding: str, rationale: str) -> list[dict]:
    """The SFT record messages that teach the rationale model one (context, rationale)."""
    return rationale_messages(preceding) + [{"role": "assistant", "content": rationale.strip()}]
