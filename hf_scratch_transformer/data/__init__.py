"""Data: corpus files (formats, pairing, sniffing, the languages a header names), loading them as `datasets` splits,
the joint BPE tokenizer, tokenising and filtering, and training batches. Imports the package root only (errors), never
training/ or translation/."""
