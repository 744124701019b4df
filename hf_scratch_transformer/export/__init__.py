"""Export of a saved model to other runtimes: CTranslate2. Imports the package root and translation/ only."""
