"""Evaluation metrics over scored completions (Spring's process metrics in spring_metrics)."""
