"""Data: corpus files (formats, pairing, sniffing), loading them as `datasets` splits, the joint BPE tokenizer,
tokenising and filtering, and training batches. Imports the package root only (errors), never training/ or
translation/."""
