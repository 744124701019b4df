"""Translation around the core (the package root's translation_core and pipeline): loading a saved model,
`translate()`, the backends, the command line and the demo. May import the package root and data/ (the tokenizer's
language pair, the shipped corpus's examples); never training/."""
