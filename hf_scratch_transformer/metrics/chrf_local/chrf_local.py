"""chrF / chrF++ as an offline `evaluate` metric: `evaluate.load(<path to this folder>)`.

Same score as the Hub-hosted `chrf` script, computed with the installed `sacrebleu` package.
"""

import datasets
import evaluate
import sacrebleu

_FEATURES = [
    datasets.Features(
        {"predictions": datasets.Value("string"), "references": datasets.Sequence(datasets.Value("string"))}
    ),
    datasets.Features({"predictions": datasets.Value("string"), "references": datasets.Value("string")}),
]


class ChrfLocal(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Character n-gram F-score (Popović, 2015); word_order=2 gives chrF++.",
            citation="@inproceedings{popovic-2015-chrf, title={chrF: character n-gram F-score}, year={2015}}",
            inputs_description="predictions: list of str; references: list of str or list of list of str.",
            features=_FEATURES,
        )

    def _compute(self, predictions, references, char_order=6, word_order=0, beta=2):
        references = [[reference] if isinstance(reference, str) else reference for reference in references]
        reference_streams = [list(stream) for stream in zip(*references)]
        metric = sacrebleu.CHRF(char_order=char_order, word_order=word_order, beta=beta)
        result = metric.corpus_score(predictions, reference_streams)
        return {"score": result.score, "char_order": char_order, "word_order": word_order, "beta": beta}
