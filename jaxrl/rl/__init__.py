"""GRPO math: group-relative advantages, the clipped-ratio loss with k3 KL, chunked log-probs."""
