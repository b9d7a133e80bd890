"""tokstream: corpora to block-aligned MDS shards, and GPT-2 training from them that survives preemption."""
