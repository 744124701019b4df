"""A `translation` pipeline for transformers 5, which removed the built-in one; it translates through the package's
translation core (translation_core.py), so it gives what the command line and `translate()` give.

A directory saved by the pipeline (`translation_pipeline(model, tokenizer).save_pretrained(dir)`, which is how train.py
saves its models) carries the model, its tokenizer, this file and the files it imports (translation_core.py and,
through it, errors.py, documents.py, protected_spans.py, glossary.py), and the model's config has a
`custom_pipelines` entry, so `pipeline("translation", model=dir, trust_remote_code=True)` works in any process.
With the package imported,
`hf_scratch_transformer.translation_pipeline(model_or_dir)` also accepts a model object.
This file imports only transformers and its siblings: they are copied into saved directories for
`trust_remote_code=True`.
"""

import copy
import os

from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, Pipeline, pipeline
from transformers.dynamic_module_utils import custom_object_save

from .translation_core import DecodingOptions, TextOptions, TorchBackend, check_tokenizer_fits, translate_texts

# call-time keyword arguments that are options of the core; any other goes to generate()
CORE_OPTIONS = ("num_beams", "num_return_sequences", "max_new_tokens", "max_len_a", "max_len_b")
TEXT_OPTIONS = ("segment", "source_lang", "protect", "protect_kinds", "protect_patterns", "glossary",
                "max_sentence_tokens")


class TranslationPipeline(Pipeline):
    """text or list of texts -> [{"translation_text": ...}] per text.

    Keyword arguments (at creation or call): `num_beams`, `max_new_tokens`, `max_len_a` / `max_len_b` (the length
    bound of the core, default 1.5 and 10), `num_return_sequences=N` (then each text gives a list of N
    {"translation_text", "score"}, best first); how texts are read (translation_core.TextOptions): `segment`,
    `source_lang`, `protect`, `protect_kinds`, `protect_patterns`, `glossary` (a Glossary, a dict or (source,
    target) pairs); `return_details=True` adds "confidence", "spans" and "glossary" to each result. Any other
    keyword goes to `generate()` (`length_penalty=1.2`, ...). `batch_size` (default 32) is the core's: the
    sentences of all texts are sorted by length and translated in batches, results in input order; a text of
    white space only comes back as it is.
    """

    _load_tokenizer = True
    _load_processor = False
    _load_image_processor = False
    _load_video_processor = False
    _load_feature_extractor = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.tokenizer is not None:
            check_tokenizer_fits(self.tokenizer, getattr(self.model.config, "vocab_size", None))

    def __call__(self, inputs, batch_size=None, **kwargs):
        """Strings and lists of strings go through the core in one call; datasets and generators item by item."""
        if not isinstance(inputs, (str, list, tuple)) and hasattr(inputs, "__iter__"):
            return super().__call__(inputs, batch_size=batch_size, **kwargs)
        _, forward_params, _ = self._sanitize_parameters(**kwargs)
        forward_params = {**self._forward_params, **forward_params}
        batch_size = batch_size if batch_size is not None else self._batch_size
        if batch_size is not None:
            forward_params["batch_size"] = batch_size
        texts = [inputs] if isinstance(inputs, str) else inputs  # anything else is refused by the core, named
        results = self._translate(texts, **forward_params)
        if isinstance(inputs, str):
            return results[0]
        # one translation per text: a flat list of dicts, as the transformers 4 pipeline returned
        return [result[0] for result in results] if "num_return_sequences" not in forward_params else results

    def _sanitize_parameters(self, **kwargs):
        return {}, kwargs, {}

    def save_pretrained(self, save_directory, **kwargs) -> None:
        """The model and tokenizer (`Pipeline.save_pretrained`), then this file and the files it imports, copied by
        transformers' `custom_object_save` (its way of saving a custom pipeline's code): the directory then works with
        `pipeline("translation", model=save_directory, trust_remote_code=True)` where the package is not installed."""
        super().save_pretrained(save_directory, **kwargs)
        if os.path.isdir(save_directory):  # transformers logs an error and saves nothing into a file's path
            custom_object_save(self, save_directory)

    def _translate(self, texts, **options) -> list[list[dict]]:
        core = {name: options.pop(name) for name in (*CORE_OPTIONS, "batch_size") if name in options}
        reading = TextOptions(**{name: options.pop(name) for name in TEXT_OPTIONS if name in options})
        details = bool(options.pop("return_details", False))
        n_best = "num_return_sequences" in core
        decoding = DecodingOptions(with_scores=n_best or details, **core)
        found = translate_texts(TorchBackend(self.model, **options), self.tokenizer, texts, decoding, reading)
        results = []
        for translation in found:
            extra = ({"confidence": translation.confidence, "spans": translation.spans,
                      "glossary": translation.glossary} if details else {})
            if not n_best:
                results.append([{"translation_text": translation.text, **extra}])
            else:
                results.append([{"translation_text": h.text, "score": h.score, **extra} for h in translation.hypotheses])
        return results

    def preprocess(self, text):
        return {"text": text}

    def _forward(self, model_inputs, **options):
        return {"results": self._translate([model_inputs["text"]], **options)[0]}

    def postprocess(self, model_outputs):
        return model_outputs["results"]


def translation_pipeline(model, tokenizer=None, **kwargs) -> TranslationPipeline:
    """A TranslationPipeline from a saved directory / hub id or from a model object and its tokenizer.

    Extra keyword arguments (`device`, `batch_size`, `num_beams`, ...) go to `transformers.pipeline`.
    """
    if isinstance(model, (str, bytes)) or hasattr(model, "__fspath__"):
        tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(model)
        model = AutoModelForSeq2SeqLM.from_pretrained(model, use_safetensors=True)
    if tokenizer is None:
        raise ValueError("Pass the tokenizer that goes with the model object: translation_pipeline(model, tokenizer).")
    return pipeline(
        "translation", model=model, tokenizer=tokenizer, config=_config_for_pipeline(model.config),
        pipeline_class=TranslationPipeline, **kwargs
    )


def _config_for_pipeline(config):
    """A copy of the model's config for `pipeline(config=...)`.

    transformers' `pipeline()` rewrites the `custom_pipelines` entry of the config it is given in place, replacing
    the class names under "pt" by the classes themselves (`clean_custom_task`). Given `model.config`, a second call
    then fails with `TypeError: attribute name must be string, not 'type'`, and the model's config no longer
    serialises. The copy keeps the model's config untouched; its entry is rebuilt with names, which also repairs a
    config that an earlier direct `pipeline(..., config=model.config)` call has rewritten.
    """
    config = copy.deepcopy(config)
    entries = getattr(config, "custom_pipelines", None) or {}
    for task, entry in entries.items():
        classes = entry.get("pt", ())
        classes = [classes] if isinstance(classes, (str, type)) else classes
        entries[task] = {**entry, "pt": [c if isinstance(c, str) else c.__name__ for c in classes]}
    return config
