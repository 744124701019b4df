"""A `translation` pipeline for transformers 5, which removed the built-in one.

Every saved model directory carries this file and a `custom_pipelines` entry in its config, so
`pipeline("translation", model=dir, trust_remote_code=True)` works in any process. With the package imported,
`hf_scratch_transformer.translation_pipeline(model_or_dir)` also accepts a model object.
This file imports only transformers: it is copied into saved directories for `trust_remote_code=True`.
"""

import copy

from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, GenerationConfig, Pipeline, pipeline


class TranslationPipeline(Pipeline):
    """text or list of texts -> [{"translation_text": ...}] per text.

    Call-time keyword arguments go to `generate()` (`num_beams=4`, `max_new_tokens=64`, ...);
    `truncation=False` turns off truncation of over-long inputs (the model then raises a clear error).
    """

    _pipeline_calls_generate = True
    _load_tokenizer = True
    _load_processor = False
    _load_image_processor = False
    _load_video_processor = False
    _load_feature_extractor = False
    # Only fills what the model's own generation_config leaves unset.
    _default_generation_config = GenerationConfig(max_new_tokens=256)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        vocab_size = getattr(self.model.config, "vocab_size", None)
        if self.tokenizer is not None and vocab_size is not None and len(self.tokenizer) > vocab_size:
            raise ValueError(
                f"The tokenizer has {len(self.tokenizer)} tokens but the model only {vocab_size} embeddings: it "
                "belongs to another model. Pass the tokenizer saved with these weights."
            )

    def __call__(self, text, **kwargs):
        if isinstance(text, str) and not text.strip():  # an empty text translates to an empty text, as the CLI
            return [{"translation_text": ""}]
        if isinstance(text, list) and any(isinstance(item, str) and not item.strip() for item in text):
            filled = [item for item in text if not (isinstance(item, str) and not item.strip())]
            translated = iter(self(filled, **kwargs) if filled else [])
            return [{"translation_text": ""} if isinstance(item, str) and not item.strip() else next(translated)
                    for item in text]
        if isinstance(text, list) and not text:
            return []
        results = super().__call__(text, **kwargs)
        # One translation per input of a list: a flat list of dicts, as the transformers 4 pipeline returned.
        if isinstance(text, list) and all(len(result) == 1 for result in results):
            return [result[0] for result in results]
        return results

    def _sanitize_parameters(self, truncation=None, **generate_kwargs):
        preprocess_params = {"truncation": truncation} if truncation is not None else {}
        beams = generate_kwargs.get("num_beams")
        if beams is not None and (isinstance(beams, bool) or not isinstance(beams, int) or beams < 1):
            raise ValueError(f"num_beams must be a whole number of at least 1, got {beams!r}: use 1 for greedy "
                             "decoding, 4 or 5 for beam search.")
        return preprocess_params, generate_kwargs, {}

    def preprocess(self, text: str, truncation: bool = True):
        if not isinstance(text, str):
            raise TypeError(f"The translation pipeline takes a string or a list of strings, got {type(text).__name__}.")
        return self.tokenizer(text, return_tensors="pt", truncation=truncation)

    def _forward(self, model_inputs, **generate_kwargs):
        vocab_size = getattr(self.model.config, "vocab_size", None)
        ids = model_inputs["input_ids"]
        if vocab_size is not None and ids.numel() and (int(ids.max()) >= vocab_size or int(ids.min()) < 0):
            bad = sorted({int(i) for i in ids.flatten().tolist() if i >= vocab_size or i < 0})
            raise ValueError(f"input ids {bad[:10]} are outside the model's vocabulary (0..{vocab_size - 1}): the "
                             "tokenizer belongs to another model; use the tokenizer saved with these weights.")
        generate_kwargs = self._prepare_generate_kwargs(generate_kwargs)
        return {"output_ids": self.model.generate(**model_inputs, **generate_kwargs)}

    def postprocess(self, model_outputs):
        return [
            {"translation_text": self.tokenizer.decode(ids, skip_special_tokens=True)}
            for ids in model_outputs["output_ids"]
        ]


def translation_pipeline(model, tokenizer=None, **kwargs) -> TranslationPipeline:
    """A TranslationPipeline from a saved directory / hub id or from a model object and its tokenizer.

    Extra keyword arguments (`device`, `batch_size`, ...) go to `transformers.pipeline`.
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
