"""Fill the model-card template (top-level `model_card.md`) with a run's measured figures."""

from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData


def render_model_card(template_path: str | Path, *, model_name: str, source_lang: str, target_lang: str,
                      dataset_name: str, results: dict[str, dict[str, float]], **facts) -> str:
    """The card as Markdown: YAML metadata (languages, tags, model-index with BLEU/chrF) and the template's sections.

    `results` maps a decoding name ("greedy", "beam 4") to {"bleu": ..., "chrf": ...}; `facts` fill the other
    template fields (architecture, hyperparameters, timings, hardware, sample translations...).
    """
    eval_results = [
        EvalResult(
            task_type="translation", dataset_type=dataset_name, dataset_name=facts.get("dataset_description", dataset_name),
            dataset_split="test", metric_type=metric, metric_value=scores[metric],
            metric_name=f"{metric.upper() if metric == 'bleu' else 'chrF'} ({decoding})",
        )
        for decoding, scores in results.items()
        for metric in ("bleu", "chrf")
    ]
    card_data = ModelCardData(
        language=[source_lang, target_lang],
        license="apache-2.0",
        library_name="transformers",
        pipeline_tag="translation",
        tags=["translation", "hf-scratch-transformer", "transformer", "from-scratch"],
        datasets=[dataset_name],
        metrics=["bleu", "chrf"],
        model_name=model_name,
        eval_results=eval_results,
    )
    rows = [{"decoding": decoding, **scores} for decoding, scores in results.items()]
    card = ModelCard.from_template(
        card_data, template_path=str(template_path), model_name=model_name, source_lang=source_lang,
        target_lang=target_lang, results_rows=rows, **facts,
    )
    return str(card)
