"""Formal logic for Spring's process reward: a safe s-expression step language (sexpr), task
theories built with z3's constructors (z3_theory), and the step checker (step_checker).
Nothing here imports jax."""
