"""Training recipes: a BPE tokenizer, a small Qwen3 target and a DFlash drafter."""
