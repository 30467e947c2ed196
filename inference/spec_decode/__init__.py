"""Speculative decoding (vLLM's --speculative-config): drafts proposed per sequence, verified
by the target model in one step, accepted so that the output keeps the target's distribution."""
