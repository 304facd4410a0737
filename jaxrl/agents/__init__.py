"""Graph of States: abductive investigation by role-aligned agents over a symbolic belief state.

graph.py     the causal graph (Signal, Evidence, Hypothesis nodes; support, refute, refines,
             causal edges)
state.py     the state machine over hypothesis levels (drill down, backtrack, report)
chat.py      the chat-client interface (OpenAI-compatible server or in-process model)
replies.py   JSON replies: extraction, validation, bounded retry, token meter
schemas.py   the validators of each agent turn
roles.py     roles and prompts per domain, from roles/*.yaml
agents.py    the central agent's and the experts' turns, with their fallbacks
gos.py       the investigation loop and its report
baseline.py  the chain-of-thought baseline
grounding.py evidence grounding and answer scoring
metrics.py   per-case metrics and their summary
render.py    the graph as a picture
"""
