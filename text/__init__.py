"""Torch-free text handling: the tokenizer, incremental detokenization and chat templates."""
