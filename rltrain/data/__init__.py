"""Prompt data: verl-format rows from parquet/jsonl files, the embedded synthetic task, and the char tokenizer."""
