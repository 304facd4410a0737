"""Investigation environments: cases whose evidence is revealed only when an agent asks for it.

`base.Case` is the interface (signals up front, tools to request the rest, a gold root cause at
two granularities); `diagnosis.generate_case` builds offline incident cases deterministically from
a seed.
"""
